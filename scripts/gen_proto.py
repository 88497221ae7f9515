"""Regenerate client/tensord/_proto/ from proto/ (run after editing a .proto).

    python scripts/gen_proto.py           # write the generated code
    python scripts/gen_proto.py --check   # exit 1 when the committed code is stale

The generated code is committed so that installing tensord needs no grpcio-tools.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
OUTPUT = REPO / "client" / "tensord" / "_proto"
# protoc writes tensord/v1/tensord_pb2.py; the package lives at tensord._proto.tensord.v1
IMPORT_FIX = (
    re.compile(r"^from tensord\.v1 import", re.MULTILINE),
    "from tensord._proto.tensord.v1 import",
)


def generate(into: Path) -> None:
    from grpc_tools import protoc  # a dev/test dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={into}",
        f"--pyi_out={into}",
        f"--grpc_python_out={into}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in into.rglob("*.py*"):
        text = path.read_text()
        path.write_text(IMPORT_FIX[0].sub(IMPORT_FIX[1], text))
    for package in [into, *[d for d in into.rglob("*") if d.is_dir()]]:
        (package / "__init__.py").touch()


def differences(a: Path, b: Path) -> list[str]:
    files_a = {
        p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    files_b = {
        p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    changed = [str(p) for p in files_a & files_b if not filecmp.cmp(a / p, b / p, shallow=False)]
    return sorted(changed + [str(p) for p in files_a ^ files_b])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = differences(fresh, OUTPUT) if OUTPUT.exists() else ["(missing)"]
        if args.check:
            for name in stale:
                print(f"stale: {name}")
            return 1 if stale else 0
        import shutil

        shutil.rmtree(OUTPUT, ignore_errors=True)
        shutil.copytree(fresh, OUTPUT)
        print(f"wrote {OUTPUT.relative_to(REPO)} ({len(stale)} files changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
