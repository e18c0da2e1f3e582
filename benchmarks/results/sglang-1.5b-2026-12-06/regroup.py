"""Re-cut a gpu-stage folder's pieces into larger parts (same manifest schema, same stage.sh)."""
import json, os, shutil, sys, hashlib
src, dst, mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
cap = int(mib * (1 << 20))
m = json.load(open(f"{src}/drv/manifest.json"))
os.makedirs(f"{dst}/drv", exist_ok=True)
for f in ("stage.sh", "root"):
    shutil.copy(f"{src}/drv/{f}", f"{dst}/drv/{f}")
part, fill = 1, 0
def pdir(n):
    d = f"{dst}/q{n:02d}"; os.makedirs(d, exist_ok=True); return d
files = []
for f in m["files"]:
    data = b"".join(open(f"{src}/{p}/{piece}", "rb").read() for piece, p in f["pieces"])
    assert hashlib.sha256(data).hexdigest() == f["sha256"], f["name"]
    pieces, off, i = [], 0, 0
    while off < len(data) or (off == 0 and not data):
        room = cap - fill
        if room <= 0:
            part, fill = part + 1, 0; room = cap
        chunk = data[off:off + room]
        name = f"{f['name']}.{i:03d}"
        open(f"{pdir(part)}/{name}", "wb").write(chunk)
        pieces.append([name, f"q{part:02d}"]); fill += len(chunk); off += len(chunk); i += 1
        if not data: break
    files.append({**f, "pieces": pieces})
json.dump({**m, "files": files}, open(f"{dst}/drv/manifest.json", "w"))
print(dst, part, "parts")
