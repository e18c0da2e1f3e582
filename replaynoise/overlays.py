"""A campaign's variant written as an overlay of its base. ``--configfile BASE VARIANT`` makes Snakemake merge the
two key by key (mappings merged, anything else replaced), so the variant file holds only what it changes:

- ``overlay_of``: the base file, relative to the variant's folder (what ``configfiles`` puts first), a whole file;
- ``rename_configs``: new names for the base's configurations (old: new), under which the variant's outputs,
  and its committed reference, sit beside the base's.

Both keys are applied and removed before validation: a variant written as an overlay validates to exactly the
mapping, and so the analysis hash, of the same variant written out in full.

    python -m replaynoise.overlays FILE   # the --configfile arguments that run FILE: its base first
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

OVERLAY_KEY, RENAME_KEY = "overlay_of", "rename_configs"


def configfiles(path: str | Path) -> list[Path]:
    """The files that make up a campaign file: its base first where it is an overlay. A base is a whole file:
    ``rename_configs`` and ``configs`` of an overlay use its base's configuration names, which an overlay of an
    overlay would have to trace back through both."""
    path = Path(path)
    base = (yaml.safe_load(path.read_text()) or {}).get(OVERLAY_KEY)
    if base is None:
        return [path]
    full = path.parent / str(base)
    if not full.is_file():
        raise ValueError(f"{path}: {OVERLAY_KEY}: {base!r} is not a file beside it ({full})")
    if (yaml.safe_load(full.read_text()) or {}).get(OVERLAY_KEY) is not None or full.resolve() == path.resolve():
        raise ValueError(f"{path}: {OVERLAY_KEY}: {base!r} is an overlay itself; an overlay's base is a whole file")
    return [full, path]


def merged(base: dict, overlay: dict) -> dict:
    """``overlay`` merged over ``base`` as Snakemake merges successive --configfile files."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_campaign(path: str | Path) -> dict:
    """The raw config a run of ``path`` sees (its bases merged under it), before validation."""
    config: dict = {}
    for file in configfiles(path):
        config = merged(config, yaml.safe_load(file.read_text()) or {})
    return config


def misordered(paths: list[str | Path]) -> str | None:
    """What is wrong with the order of the --configfile files given, if anything: an overlay must come after its
    base, which Snakemake cannot know (it merges whatever it is given)."""
    given = [Path(p).resolve() for p in paths]
    for at, path in enumerate(given):
        files = configfiles(path)
        if len(files) == 2 and files[0].resolve() not in given[:at]:
            return (
                f"{path} is an overlay of {files[0]} ({OVERLAY_KEY}), which must come before it: "
                f"--configfile {' '.join(map(str, files))}"
            )
    return None


def apply_overlay(config: dict) -> dict:
    """``config`` with its configurations renamed as ``rename_configs`` says and both overlay keys gone; a
    rename of a configuration that is not there, or onto a name that is kept, is refused by key."""
    renames = config.get(RENAME_KEY, {})
    configs = config.get("configs")
    if (
        not isinstance(renames, dict)
        or not all(isinstance(n, str) for n in [*renames, *renames.values()])
        or (renames and not isinstance(configs, dict))
    ):
        raise ValueError(
            f"config key {RENAME_KEY}: a mapping of configuration names (old: new) over a configs "
            f"mapping, got {renames!r}"
        )
    for old, new in renames.items():
        if old not in configs:
            raise ValueError(
                f"config key {RENAME_KEY}.{old}: no configuration {old!r} to rename (the base "
                f"--configfile must come first; configurations: {', '.join(sorted(configs))})"
            )
        if new in configs and new not in renames:
            raise ValueError(f"config key {RENAME_KEY}.{old}: {new!r} is already a configuration of this run")
    if len(set(renames.values())) < len(renames):
        raise ValueError(f"config key {RENAME_KEY}: two configurations renamed to one name ({renames})")
    out = {key: value for key, value in config.items() if key not in (OVERLAY_KEY, RENAME_KEY)}
    if renames:
        out["configs"] = {renames.get(name, name): settings for name, settings in configs.items()}
    return out


if __name__ == "__main__":
    print(" ".join(str(p) for p in configfiles(sys.argv[1])))
