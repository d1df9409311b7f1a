"""Task fixtures made deterministically by code, from a spec the teacher writes.

A teacher cannot type a PNG, a WAV file or a binary into JSON; it names one instead
(``TaskReply.fixtures``) and ``render`` makes the bytes, the same bytes for the same spec:

- ``png-text``: black text on white (Pillow, a matplotlib dependency), for OCR tasks;
- ``wav-tones``: 16-bit mono sine tones, one after another (the stdlib ``wave``);
- ``stripped-binary``: C sources compiled on this machine, static and stripped (``gcc``);
- ``vendored-package``: a Python package as a reproducible ``.tar.gz`` (mtimes 0, sorted);
- ``video``: tones and frames of text through ``ffmpeg`` when it is on PATH.

The files land under ``environment/`` at ``path``; the Dockerfile COPYs them.
"""

from __future__ import annotations

import gzip
import io
import math
import shutil
import struct
import subprocess
import tarfile
import tempfile
import wave
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class FixtureError(Exception):
    """A fixture that cannot be made here (the message goes back to the teacher)."""


class Fixture(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["png-text", "wav-tones", "stripped-binary", "vendored-package", "video"]
    path: str
    """Where the file goes, relative to environment/ (e.g. ``data/scan.png``)."""
    text: str = ""
    """png-text / video: the text drawn."""
    tones_hz: list[float] = Field(default_factory=list)
    """wav-tones / video: frequencies, one tone each."""
    seconds_per_tone: float = Field(default=0.25, gt=0, le=10)
    sample_rate: int = Field(default=16000, ge=4000, le=48000)
    package: str = ""
    """vendored-package: the top-level package name."""
    files: dict[str, str] = Field(default_factory=dict)
    """stripped-binary: C sources (``main.c``...); vendored-package: its files
    (``__init__.py``...)."""

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v.removeprefix("environment/"))
        if not v or p.is_absolute() or ".." in p.parts:
            raise ValueError(f"fixture path {v!r} must be relative to environment/, no '..'")
        return p.as_posix()


def render(fixture: Fixture, timeout: float = 120.0) -> bytes:
    """The fixture's bytes; ``FixtureError`` when it cannot be made."""
    make = {"png-text": _png, "wav-tones": _wav, "stripped-binary": _binary,
            "vendored-package": _package, "video": _video}[fixture.kind]
    return make(fixture, timeout)


def _png(f: Fixture, timeout: float) -> bytes:
    from PIL import Image, ImageDraw, ImageFont

    if not f.text:
        raise FixtureError(f"{f.path}: png-text needs text")
    font = ImageFont.load_default(size=28)
    lines = f.text.splitlines() or [f.text]
    width = 40 + max(int(font.getlength(line)) for line in lines)
    image = Image.new("L", (width, 30 + 40 * len(lines)), 255)
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((20, 15 + 40 * i), line, fill=0, font=font)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


def _samples(f: Fixture) -> bytes:
    if not f.tones_hz:
        raise FixtureError(f"{f.path}: {f.kind} needs tones_hz")
    n = int(f.sample_rate * f.seconds_per_tone)
    frames = bytearray()
    for hz in f.tones_hz:
        for i in range(n):
            value = int(12000 * math.sin(2 * math.pi * hz * i / f.sample_rate))
            frames += struct.pack("<h", value)
    return bytes(frames)


def _wav(f: Fixture, timeout: float) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(f.sample_rate)
        w.writeframes(_samples(f))
    return out.getvalue()


def _run(argv: list[str], cwd: Path, timeout: float) -> None:
    try:
        subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       check=True, stdin=subprocess.DEVNULL)
    except subprocess.CalledProcessError as e:
        raise FixtureError(f"{argv[0]} failed (exit {e.returncode}): {e.stderr[-2000:]}") \
            from None
    except subprocess.TimeoutExpired:
        raise FixtureError(f"{argv[0]} took over {timeout:.0f} s") from None


def _binary(f: Fixture, timeout: float) -> bytes:
    sources = [name for name in f.files if name.endswith(".c")]
    if not sources:
        raise FixtureError(f"{f.path}: stripped-binary needs C sources in files (main.c)")
    if shutil.which("gcc") is None:
        raise FixtureError("gcc is not on PATH: no stripped binaries on this machine")
    with tempfile.TemporaryDirectory(prefix="tmax-fixture-") as tmp:
        for name, text in f.files.items():
            (Path(tmp) / PurePosixPath(name).name).write_text(text)
        _run(["gcc", "-static", "-s", "-O2", "-o", "out.bin",
              *sorted(PurePosixPath(s).name for s in sources)], Path(tmp), timeout)
        return (Path(tmp) / "out.bin").read_bytes()


def _package(f: Fixture, timeout: float) -> bytes:
    if not f.package.isidentifier() or not f.files:
        raise FixtureError(f"{f.path}: vendored-package needs a package name and files")
    files = {"pyproject.toml": f'[project]\nname = "{f.package}"\nversion = "0.1.0"\n'}
    files |= {f"{f.package}/{name}": text for name, text in f.files.items()}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(f"{f.package}-0.1.0/{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(out.getvalue(), compresslevel=9, mtime=0)  # no time in the header


def _video(f: Fixture, timeout: float) -> bytes:
    if shutil.which("ffmpeg") is None:
        raise FixtureError("ffmpeg is not on PATH: no video fixtures on this machine; "
                           "use another fixture kind")
    with tempfile.TemporaryDirectory(prefix="tmax-fixture-") as tmp:
        (Path(tmp) / "a.wav").write_bytes(_wav(f, timeout))
        _run(["ffmpeg", "-nostdin", "-y", "-f", "lavfi", "-i",
              f"color=c=white:s=320x240:d={len(f.tones_hz) * f.seconds_per_tone}",
              "-i", "a.wav", "-shortest", "-fflags", "+bitexact", "-map_metadata", "-1",
              "out.mp4"], Path(tmp), timeout)
        return (Path(tmp) / "out.mp4").read_bytes()
