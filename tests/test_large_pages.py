"""Whether a runtime cache's weights sit in large pages, and re-reading them into large pages where they
do not (engines/large_pages.py; prepared.py's use of it is tested in test_prepared.py)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from edge_sd.engines import large_pages
from edge_sd.engines.large_pages import Residency


def smaps(path: Path) -> str:
    """Three mappings of 4 MiB: two of `path` (the first whole resident, part in 2 MiB entries; the
    second a quarter resident), one of another file."""
    def mapping(start: int, offset: int, name: str, rss_kb: int, pmd_kb: int) -> str:
        return (f"{start:x}-{start + (4 << 20):x} r--p {offset:08x} fe:01 1234    {name}\n"
                f"Size:               4096 kB\nRss:             {rss_kb} kB\nFilePmdMapped:   {pmd_kb} kB\n"
                "Locked:                0 kB\n")
    return (mapping(0x7F0000000000, 0, str(path), 4096, 2048) + mapping(0x7F1000000000, 8 << 20, str(path), 1024, 0)
            + mapping(0x7F2000000000, 0, "/usr/lib/libc.so.6", 512, 0))


def test_residency_sums_the_files_mappings_only(tmp_path: Path) -> None:
    data = tmp_path / "a dir" / "model.onnx.data"  # a path with a space: the header's last field whole
    held = large_pages.residency(data, smaps(data))
    assert held == Residency(5120 << 10, 2048 << 10, ((0, 4 << 20),)) and held.share == pytest.approx(0.4)
    # spans: the mappings at least half resident (what the load read), as (file offset, length)
    assert large_pages.residency(tmp_path / "other", smaps(data)) is None  # never mapped: nothing said
    assert large_pages.residency(data, smaps(data).replace("FilePmdMapped", "Other")) is None  # a kernel without it
    assert Residency(0, 0).share == 1.0


def test_residency_of_this_process_reads_its_own_smaps(tmp_path: Path) -> None:
    import mmap

    data = tmp_path / "w.bin"
    data.write_bytes(b"\1" * (1 << 20))
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == 256  # touch every page
        held = large_pages.residency(data)
    if held is None:
        pytest.skip("this kernel's smaps has no FilePmdMapped")
    assert held.resident >= 1 << 20


def test_wanted_follows_the_switch_and_the_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "model.onnx.data"
    monkeypatch.setattr(large_pages.platform, "system", lambda: "Linux")
    monkeypatch.delenv(large_pages.ENV, raising=False)
    assert large_pages.wanted(data)
    monkeypatch.setenv(large_pages.ENV, "0")
    assert not large_pages.wanted(data)
    monkeypatch.delenv(large_pages.ENV)
    large_pages.mark_of_no_use(data, Residency(100, 1), None)
    assert json.loads((tmp_path / large_pages.MARKER).read_text())["kernel"] == platform.release()
    assert not large_pages.wanted(data)
    (tmp_path / large_pages.MARKER).write_text(json.dumps({"kernel": "another"}))
    assert large_pages.wanted(data)
    (tmp_path / large_pages.MARKER).write_text("not json")
    assert large_pages.wanted(data)


@pytest.mark.parametrize("held, small", [(Residency(large_pages.MIN_RESIDENT, 0), True),
                                         (Residency(large_pages.MIN_RESIDENT - 1, 0), False),
                                         (Residency(large_pages.MIN_RESIDENT, large_pages.MIN_RESIDENT // 2), False),
                                         (None, False)])
def test_too_small_only_for_a_large_mapping_mostly_in_small_pages(held: Residency | None, small: bool,
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(large_pages, "wanted", lambda data: True)
    monkeypatch.setattr(large_pages, "residency", lambda data: held)
    assert large_pages.too_small(tmp_path / "d") == (held if small else None)


def test_reread_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(range(256)) * 40000)
    if not hasattr(large_pages.os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    assert large_pages.reread(data, ((0, data.stat().st_size),)) >= 0
    assert data.read_bytes() == bytes(range(256)) * 40000


@pytest.mark.parametrize("spans, dropped", [
    # a span in the middle: the whole 2 MiB stretches before and after it, not the partial ones
    (((3 << 20, 4 << 20),), [(0, 2 << 20), (8 << 20, 20 << 20)]),
    # two spans with a gap between them; the file's last stretch is dropped whole up to its end
    (((0, 2 << 20), (6 << 20, 1 << 20)), [(2 << 20, 6 << 20), (8 << 20, 20 << 20)]),
    (((0, 20 << 20),), []),  # all of it spanned: nothing dropped
    ((), []),  # nothing known to be read: all of it kept
])
def test_reread_drops_again_only_whole_stretches_outside_the_spans(
        spans: tuple[tuple[int, int], ...], dropped: list[tuple[int, int]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(large_pages.os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    data = tmp_path / "model.onnx.data"
    data.write_bytes(b"\0" * (20 << 20))
    calls = []
    monkeypatch.setattr(large_pages.os, "posix_fadvise",
                        lambda fd, offset, length, advice: calls.append((offset, length, advice)))
    large_pages.reread(data, spans)
    again = [(o, o + n) for o, n, advice in calls[2:] if advice == large_pages.os.POSIX_FADV_DONTNEED]
    assert calls[:2] == [(0, 0, large_pages.os.POSIX_FADV_DONTNEED), (0, 0, large_pages.os.POSIX_FADV_SEQUENTIAL)]
    assert again == dropped


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise and /proc/self/smaps are Linux's")
def test_release_unmaps_clean_pages_and_leaves_written_ones(tmp_path: Path) -> None:
    """What the load read and no forward reads again stops counting (a mapping of a runtime cache's
    data file is private and writable, as ONNX Runtime maps it); a mapping with pages of its own would
    lose them, and is left alone. The bytes read back afterwards are the file's."""
    import ctypes
    import mmap

    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    with open(data, "r+b") as f:
        clean = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        written = mmap.mmap(f.fileno(), 8 << 20, access=mmap.ACCESS_COPY)
    for m in (clean, written):
        sum(m[i] for i in range(0, len(m), 4096))  # read every page
    written[5] = 7  # one page copied on write

    def held(m: mmap.mmap) -> int:
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        text = Path("/proc/self/smaps").read_text()
        at = text.index(f"{address:x}-")
        return int(text[at:].split("Rss:", 1)[1].split()[0]) << 10

    before = held(written)
    assert held(clean) == 16 << 20 and before > 0
    assert large_pages.release(data) == 16 << 20
    assert held(clean) == 0 and held(written) == before
    assert clean[:256] == bytes(range(256)) and clean[-1] == 255 and written[5] == 7
    assert large_pages.release(tmp_path / "other") == 0
