"""The engine's two KV layouts, its re-feeding of short forwards, and the execution-provider options."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_sd.engines import providers
from edge_sd.engines.ort import OrtEngine
from edge_sd.errors import ProviderError
from edge_sd.manifest import load_engine_manifest

IDS = np.arange(5, 45)


def steps(engine: OrtEngine, ids: np.ndarray) -> np.ndarray:
    """Logits of every position after the first, fed one token at a time."""
    engine.reset()
    engine.forward(ids[:1])
    return np.stack([engine.forward(ids[i : i + 1])[0] for i in range(1, len(ids))])


def test_shared_cache_grows_without_losing_positions(tiny_root: Path) -> None:
    """A shared buffer smaller than the generation doubles as needed and keeps what it held."""
    folder = tiny_root / "engines" / "bl_llama"
    small = OrtEngine(folder, provider="cpu", threads=2, capacity=4)
    big = OrtEngine(folder, provider="cpu", threads=2)
    assert small.manifest.kv_layout == "shared" and small.capacity == 4
    got = steps(small, IDS)
    assert small.capacity >= len(IDS) and small.capacity < 2 * len(IDS) + 8
    np.testing.assert_array_equal(got, steps(big, IDS))


def test_spin_settings_compute_the_same_and_unknown_ones_are_refused(tiny_root: Path) -> None:
    """Spinning is about speed only: every setting gives the same logits; a typo is an error."""
    folder = tiny_root / "engines" / "bl_llama"
    ref = steps(OrtEngine(folder, provider="cpu", threads=2, spin="always"), IDS)
    for spin in ("run", "never"):
        np.testing.assert_array_equal(steps(OrtEngine(folder, provider="cpu", threads=2, spin=spin), IDS), ref)
    with pytest.raises(ValueError, match="spin must be one of"):
        OrtEngine(folder, provider="cpu", spin="sometimes")


@pytest.mark.parametrize("name", ["bl_llama", "sp_gemma", "bl_llama_opt"])
def test_cut_back_and_refeed_gives_the_same_logits(tiny_root: Path, name: str) -> None:
    """Rejected positions are dropped by cutting back; re-feeding other tokens there is as if fresh."""
    engine = OrtEngine(tiny_root / "engines" / name, provider="cpu", threads=2)
    other = IDS.copy()
    other[20:] += 7
    engine.forward(IDS)
    engine.truncate(20)
    assert engine.n_cached == 20
    after = engine.forward(other[20:])
    engine.reset()
    fresh = engine.forward(other)[20:]
    if engine.manifest.kv_layout == "shared":  # same positions through the same kernels: exact
        np.testing.assert_array_equal(after, fresh)
    else:
        np.testing.assert_allclose(after, fresh, atol=1e-4)


@pytest.mark.parametrize("name", ["bl_llama", "sp_gemma"])
def test_two_position_steps_are_exact(tiny_root: Path, name: str) -> None:
    """With two-position steps a one-token step re-feeds the last cached token and equals, bit for bit,
    the same position inside any longer forward; one-position steps take the one-row kernel, which
    rounds otherwise (by ~1e-6 in fp32: these engines step one position, int8 ones two)."""
    engine = OrtEngine(tiny_root / "engines" / name, provider="cpu", threads=2, min_step_positions=2)
    engine.reset()
    full = engine.forward(IDS)[1:]
    np.testing.assert_array_equal(steps(engine, IDS), full)
    raw = OrtEngine(tiny_root / "engines" / name, provider="cpu", threads=2)
    assert raw.min_step == raw.manifest.min_step_positions == 1
    assert 0.0 < np.abs(steps(raw, IDS) - full).max() < 1e-4 * np.abs(full).max()


def test_resolve_providers(monkeypatch) -> None:
    have = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(providers.ort, "get_available_providers", lambda: have)
    assert providers.resolve_providers("tensorrt") == have
    assert providers.resolve_providers("cuda") == have[1:]
    # auto takes only what edge-sd was verified on: TensorRT runs only when named.
    assert providers.resolve_providers("auto") == have[1:]
    # A model-builder graph made for the CPU runs there only: auto takes the CPU, a GPU by name is refused.
    assert providers.resolve_providers("auto", cpu_only=True) == have[2:]
    for name in ("cuda", "tensorrt"):
        with pytest.raises(ProviderError, match="made for the CPU by the model builder"):
            providers.resolve_providers(name, cpu_only=True)
    monkeypatch.setattr(providers.ort, "get_available_providers", lambda: have[2:])
    assert providers.resolve_providers("auto") == have[2:]
    with pytest.raises(ProviderError, match="'cuda' is not available"):
        providers.resolve_providers("cuda")
    with pytest.raises(ProviderError, match="unknown provider 'npu'"):
        providers.resolve_providers("npu")


def test_manifests_say_what_device_their_graph_was_made_for(tiny_root: Path, tmp_path: Path) -> None:
    """`device` is written at export; a manifest from before the field was written reads as cuda
    where its KV cache is fp16 (only --device cuda made those), else cpu."""
    import json
    import shutil

    assert load_engine_manifest(tiny_root / "engines" / "bl_llama").device == "cpu"
    folder = tmp_path / "old"
    shutil.copytree(tiny_root / "engines" / "bl_llama", folder)
    m = json.loads((folder / "engine.json").read_text())
    m.pop("device", None)
    for kv, device in (("float32", "cpu"), ("float16", "cuda")):
        (folder / "engine.json").write_text(json.dumps({**m, "kv_dtype": kv}))
        assert load_engine_manifest(folder).device == device


def test_tensorrt_options_from_the_manifest(tiny_root: Path) -> None:
    m = load_engine_manifest(tiny_root / "engines" / "sp_gemma")  # shared layout, no position_ids
    folder = tiny_root / "engines" / "sp_gemma"
    kv = f"1x{m.num_kv_heads}x{{}}x{m.head_dim}"
    opts = providers.tensorrt_options(m, folder, capacity=256, max_rows=64)
    assert opts["trt_engine_cache_enable"] and opts["trt_engine_cache_path"] == str(folder / "trt_cache")
    assert not opts["trt_fp16_enable"]
    lo = dict(item.split(":") for item in opts["trt_profile_min_shapes"].split(","))
    hi = dict(item.split(":") for item in opts["trt_profile_max_shapes"].split(","))
    assert set(lo) == {"input_ids", "attention_mask"} | {n for n in m.input_names if n.startswith("past_")}
    assert (lo["input_ids"], hi["input_ids"], hi["attention_mask"]) == ("1x1", "1x64", "1x256")
    # The shared buffer never changes size.
    assert lo["past_key_values.0.key"] == hi["past_key_values.0.key"] == kv.format(256)
    concat = replace(m, kv_layout="concat", has_position_ids=True, kv_dtype="float16")
    opts = providers.tensorrt_options(concat, folder, capacity=256, max_rows=64)
    lo = dict(item.split(":") for item in opts["trt_profile_min_shapes"].split(","))
    hi = dict(item.split(":") for item in opts["trt_profile_max_shapes"].split(","))
    assert opts["trt_fp16_enable"] and hi["position_ids"] == "1x64"
    assert (lo["past_key_values.0.value"], hi["past_key_values.0.value"]) == (kv.format(0), kv.format(255))


def _without_logits_to_keep(folder: Path, dest: Path) -> None:
    """A copy of an engine folder as exported before `logits_to_keep` (export/logits.py undone)."""
    import shutil

    from edge_sd.export.logits import load, save
    from edge_sd.manifest import KEEP_INPUT, file_entries
    from edge_sd.manifest import save as save_manifest

    shutil.copytree(folder, dest)
    model = load(dest / "model.onnx")
    g = model.graph
    cut = next(n for n in g.node if n.name == "logits_to_keep.slice")
    for n in g.node:
        n.input[:] = [cut.input[0] if i == cut.output[0] else i for i in n.input]
    for items in (g.node, g.input, g.initializer):
        for item in [x for x in items if x.name.startswith(KEEP_INPUT)]:
            items.remove(item)
    save(model, dest / "model.onnx")
    m = load_engine_manifest(dest)
    save_manifest(replace(m, input_names=[n for n in m.input_names if n != KEEP_INPUT],
                          files=file_entries(dest)), dest)


@pytest.mark.parametrize("name", ["bl_llama", "bl_llama_opt"])
def test_logits_of_the_last_positions_only(tiny_root: Path, tmp_path: Path, name: str) -> None:
    """An export's graph takes `logits_to_keep`: a forward asked for the last n positions computes the
    LM head there only, with a full forward's logits. A graph exported before it returns the same
    rows (computing them all), and `keep_logits` gives it the input, once."""
    from edge_sd.export.logits import keep_logits
    from edge_sd.manifest import KEEP_INPUT

    def run(folder: Path) -> tuple[np.ndarray, np.ndarray, int]:
        engine = OrtEngine(folder, provider="cpu", threads=2)
        full = engine.forward(IDS)
        engine.reset()
        last = engine.forward(IDS, last=3)
        return full, last, engine._io.get_outputs()[0].shape()[1]

    folder = tiny_root / "engines" / name
    assert KEEP_INPUT in load_engine_manifest(folder).input_names
    full, last, computed = run(folder)
    assert computed == 3 and last.shape == (3, full.shape[1])
    np.testing.assert_allclose(last, full[-3:], rtol=1e-5, atol=1e-5 * np.abs(full).max())
    old = tmp_path / "old"
    _without_logits_to_keep(folder, old)
    old_full, old_last, computed = run(old)
    assert computed == len(IDS)
    np.testing.assert_array_equal(old_last, old_full[-3:])
    np.testing.assert_allclose(old_full, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    assert keep_logits(old) and not keep_logits(old)
    assert run(old)[2] == 3 and KEEP_INPUT in load_engine_manifest(old).input_names
    # Feeding at least two positions a forward (int8 and int4 engines), the head runs over two rows
    # too, so that a step's logits come from the kernels a verification forward uses.
    engine = OrtEngine(folder, provider="cpu", threads=2, min_step_positions=2)
    engine.forward(IDS[:10])
    step = engine.forward(IDS[10:11], last=1)
    assert engine._io.get_outputs()[0].shape()[1] == 2 and step.shape == (1, full.shape[1])
    engine.reset()
    np.testing.assert_array_equal(step, engine.forward(IDS[:11], last=2)[-1:])


def test_consistency_is_measured_again_on_another_provider(tiny_root: Path, tmp_path: Path) -> None:
    """min_step_positions was measured where the export validated; an engine whose validation ran on
    another provider measures its forwards again at load (the same figures, no torch) and follows
    them, whatever its manifest says."""
    import json
    import shutil

    from edge_sd.engines import consistency

    src = tiny_root / "engines" / "bl_llama"
    figures = consistency.check(OrtEngine(src, provider="cpu", threads=2))
    # fp32: single steps round otherwise by ~1e-6; two-position steps and longer forwards agree exactly
    assert 0.0 < figures["single"] < consistency.CACHE_RTOL and figures["multi"] == figures["small"] == 0.0
    assert figures["min_step_positions"] == 1
    assert OrtEngine(src, provider="cpu", threads=2).consistency is None  # validated on this provider
    folder = tmp_path / "bl_llama"
    shutil.copytree(src, folder)
    m = json.loads((folder / "engine.json").read_text())
    m["validation"]["provider"] = "cuda"
    m["min_step_positions"] = 2
    (folder / "engine.json").write_text(json.dumps(m))
    engine = OrtEngine(folder, provider="cpu", threads=2)
    assert engine.consistency == figures and engine.min_step == 1 and engine.forward_count == 0
    assert OrtEngine(folder, provider="cpu", threads=2, min_step_positions=1).consistency is None


def test_scratch_logits_are_the_forwards_own_in_a_reused_buffer(tiny_root: Path) -> None:
    """forward(scratch=True) computes what a plain forward does, for every size a round feeds and past
    it (where it falls back to a new array), and writes each round's logits over the last's."""
    folder = tiny_root / "engines" / "sp_gemma"
    plain, scratch = OrtEngine(folder, provider="cpu", threads=2), OrtEngine(folder, provider="cpu", threads=2)
    views = []
    longer = np.arange(5, 80)
    for engine in (plain, scratch):
        engine.forward(longer[:3])
    start = 3
    for s in (1, 2, 5, 17, 20, 1):
        ids = longer[start : start + s]
        want = plain.forward(ids)
        got = scratch.forward(ids, scratch=True)
        np.testing.assert_array_equal(got, want)
        views.append(got)
        start += s
    assert np.shares_memory(views[0], views[-1]) and np.shares_memory(views[0], views[3])
    assert not np.shares_memory(views[4], views[0])  # 20 rows: more than the buffer holds


def test_a_window_views_offset_leaves_every_row_its_window() -> None:
    """engines/kv.py window_offset: the largest multiple of the granule at most start - window - 1,
    so that the forward's rows (from `start`) and the previous position it reads back lie in the view,
    over more than window + 1 of its positions; 0 below that, and with views off."""
    from edge_sd.engines.ort import window_offset

    for window, granule in ((512, 128), (16, 64), (5, 1)):
        for start in range(0, 3000, 7):
            offset = window_offset(start, window, granule)
            assert offset % granule == 0
            if offset:
                assert start - window - 1 - granule < offset <= start - window - 1
            else:
                assert start - window - 1 < granule
    assert window_offset(5000, 512, 0) == 0


def _gemma_with_views(tiny_root: Path, tmp_path: Path, without: bool = False) -> tuple[Path, Path]:
    """The tiny Gemma-3 after the previous-row rewrite, with window views (export/attention_steps.py)
    in `viewed` and, with `without`, without them in `before`."""
    import shutil

    from edge_sd.export import attention_steps
    from edge_sd.manifest import file_entries, save

    src = tiny_root / "engines" / "sp_gemma"
    before, viewed = tmp_path / "before", tmp_path / "viewed"
    for folder in (before, viewed) if without else (viewed,):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("runtime_cache"))
        assert attention_steps.rewrite(folder / "model.onnx") == 6
    pasts, window = attention_steps.window_views(viewed / "model.onnx")
    assert window == 16 and pasts == [f"past_key_values.{i}.key" for i in range(5)]
    m = load_engine_manifest(src)
    if without:
        save(replace(m, previous_row_attention=True, files=file_entries(before)), before)
    views = {"layers": [0, 1, 2, 3, 4], "window": 16, "granule": 0}
    save(replace(m, previous_row_attention=True, window_views=views, files=file_entries(viewed)), viewed)
    return before, viewed


def test_window_views_read_the_same_cache_from_an_offset(tiny_root: Path, tmp_path: Path) -> None:
    """export/attention_steps.py window_views on the tiny Gemma-3 (five sliding-window layers of 16
    positions over one key/value head, then a global layer), after the previous-row rewrite: with the
    offset at 0 every forward computes bit for bit what the graph before did, and a view from an
    offset reads the same positions of the same buffer (its logits differ from the whole cache's by
    rounding at most: the kernel sums positions in other blocks). A copy that does not bind the
    offset runs at 0."""
    from edge_sd.engines import consistency

    before, viewed = _gemma_with_views(tiny_root, tmp_path, without=True)
    a, b = (OrtEngine(f, provider="cpu", threads=2) for f in (before, viewed))
    assert b.can_view_windows and not a.can_view_windows
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 400, size=200)
    np.testing.assert_array_equal(a.forward(ids[:30]), b.forward(ids[:30]))
    for t in ids[30:120]:  # offset 0: the added nodes subtract nothing
        np.testing.assert_array_equal(a.forward([t]), b.forward([t]))
    b.window_granule = 32  # views from 32 on: the same keys and values, summed in other blocks
    worst = 0.0
    for t in ids[120:190]:
        x, y = a.forward([t]), b.forward([t])
        worst = max(worst, float(np.abs(x - y).max()) / float(np.abs(x).max()))
    assert b.view_offset >= 128 and worst < consistency.CACHE_RTOL
    # The export measures the views' step within the context (256 positions): 64 is the one candidate
    # whose three steps past a window of 16 fit there, and it leaves the engine with views off.
    assert consistency.window_granule(b, rng, 400) in (0, 64) and b.window_granule == 0


def test_no_window_granule_is_measured_past_the_context(
        tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A granule whose measurement would run past max_context is not tried: views stay off."""
    from edge_sd.engines import consistency

    _, viewed = _gemma_with_views(tiny_root, tmp_path)
    b = OrtEngine(viewed, provider="cpu", threads=2)
    monkeypatch.setattr(consistency, "WINDOW_GRANULES", (128, 256))
    assert consistency.window_granule(b, np.random.default_rng(5), 400) == 0
    assert b.window_granule == 0 and b.view_offset == 0


def test_the_window_granule_is_measured_against_an_engine_that_steps_alike(
        tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """consistency.window_granule compares the viewed engine with one over the whole cache that feeds
    the same minimum positions per forward and LM-head rows: export measures the views after it has
    set the engine's steps (two positions where single ones take other kernels), and a reference left
    at its session's single positions differed from it on every forward, so that no granule was found
    exact on CPUs where one is."""
    from edge_sd.engines import consistency

    _, viewed = _gemma_with_views(tiny_root, tmp_path)
    engine = OrtEngine(viewed, provider="cpu", threads=2, min_step_positions=1)
    engine.min_step, engine.head_rows = 2, 2
    seen = []
    compare = consistency.views_against_whole

    def recording(v, whole, *args, **kwargs):
        seen.append((v.min_step, v.head_rows, v.window_granule, whole.min_step, whole.head_rows,
                     whole.window_granule))
        return compare(v, whole, *args, **kwargs)

    monkeypatch.setattr(consistency, "views_against_whole", recording)
    monkeypatch.setattr(consistency, "WINDOW_GRANULES", (32, 64))  # fit the tiny context of 256
    consistency.window_granule(engine, np.random.default_rng(0), 400)
    assert seen and all(s == (2, 2, s[2], 2, 2, 0) and s[2] in (32, 64) for s in seen), seen
    assert engine.window_granule == 0 and engine.min_step == 2


def _gemma_grouped(tiny_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny Gemma-3 with window views (`viewed`) and a copy whose global layer is grouped
    (export/grouped_attention.py)."""
    import shutil

    from edge_sd.export.grouped_attention import grouped_global
    from edge_sd.manifest import file_entries, save

    _, viewed = _gemma_with_views(tiny_root, tmp_path)
    grouped = tmp_path / "grouped"
    shutil.copytree(viewed, grouped)
    assert grouped_global(grouped / "model.onnx") == ["past_key_values.5.key"]
    m = load_engine_manifest(viewed)
    save(replace(m, grouped_attention=[5], files=file_entries(grouped)), grouped)
    return viewed, grouped


def test_a_grouped_global_layer_attends_over_the_whole_cache_and_steps_compute_what_forwards_do(
        tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """export/grouped_attention.py on the tiny Gemma-3's global layer (4 query heads over one
    key/value head): its GroupQueryAttention still writes the cache (bit for bit what the graph
    before writes, through views that move in steps of 64), and the product over all heads gives
    the attention GroupQueryAttention gives, up to rounding; one-position steps compute bit for bit
    what one forward over the same positions computes; a host that binds no offsets gets the same
    logits. The control: the whole cache bound one position short, the newest position is missing
    and the logits change."""
    import onnxruntime as ort

    from edge_sd.engines import consistency
    from edge_sd.engines import engine as engine_module
    from edge_sd.engines.kv import SharedKV
    from edge_sd.manifest import GLOBAL_INPUT

    viewed, grouped = _gemma_grouped(tiny_root, tmp_path)
    a, b = (OrtEngine(f, provider="cpu", threads=2) for f in (viewed, grouped))
    ids = np.random.default_rng(7).integers(3, 400, size=230)
    for e in (a, b):
        e.window_granule = 32
    x, y = a.forward(ids[:30]), b.forward(ids[:30])
    steps, worst = [y[-1]], 0.0
    for t in ids[30:200]:
        x, y = a.forward([t]), b.forward([t])
        worst = max(worst, float(np.abs(x - y).max()) / float(np.abs(x).max()))
        steps.append(y[-1])
    assert 0.0 < worst < consistency.CACHE_RTOL
    assert b._kv._offsets[(5,)] == 192 and b._kv._whole[0] == 256  # the writer's view, the product's length
    for k in range(12):  # every layer's keys and values, the global layer's too
        np.testing.assert_array_equal(a._kv._host[k][0, 0, :200], b._kv._host[k][0, 0, :200])
    # one forward over the same positions, on an engine that binds no offsets (writers over the whole
    # cache, window layers too)
    c = OrtEngine(grouped, provider="cpu", threads=2)
    c.prepare()
    c._global_offset = None
    c._io.bind_ortvalue_input(GLOBAL_INPUT, ort.OrtValue.ortvalue_from_numpy(np.zeros((), dtype=np.int64)))
    np.testing.assert_array_equal(c.forward(ids[:200])[29:], np.stack(steps))

    # The control: one position short, so the reader misses what the writer wrote this forward.
    bind_whole = SharedKV.bind_whole
    d = OrtEngine(grouped, provider="cpu", threads=2)
    d.forward(ids[:30])
    monkeypatch.setattr(engine_module, "GROUPED_STEP", 1)
    monkeypatch.setattr(SharedKV, "bind_whole", lambda self, n, layers: bind_whole(self, n - 1, layers))
    short = d.forward(ids[30:31])
    assert np.abs(short - steps[1]).max() > 1e-3 * np.abs(steps[1]).max()


def test_released_window_positions_go_back_to_the_system_and_a_deep_cut_empties_the_cache(
        tiny_root: Path, tmp_path: Path) -> None:
    """release_window (a generator's target): as the views move on, the sliding-window layers'
    positions below them are given back (they read as zeros after; the global layer keeps all of
    its own), and every forward computes bit for bit what it computes without the release. A cut
    that a forward would read released positions after empties the cache, and what is fed again
    from the start computes what a fresh engine does; a shallower cut keeps its positions."""
    _, viewed = _gemma_with_views(tiny_root, tmp_path)
    # `freed` starts small: its cache regrows after positions were released (the global layer's are
    # copied whole, the window layers' from the released ones on).
    kept = OrtEngine(viewed, provider="cpu", threads=2)
    freed = OrtEngine(viewed, provider="cpu", threads=2, capacity=64, release_window=True)
    for e in (kept, freed):
        e.window_granule = 32
    ids = np.random.default_rng(6).integers(3, 400, size=220)
    np.testing.assert_array_equal(kept.forward(ids[:30]), freed.forward(ids[:30]))
    for t in ids[30:200]:
        np.testing.assert_array_equal(kept.forward([t]), freed.forward([t]))
    released = freed.released
    assert released == freed.view_offset >= 128 and kept.released == 0 and freed.capacity == 256
    for i in range(5):  # the window layers: nothing below the views in `freed`, their values in `kept`
        for j in range(2):
            assert not freed._kv._host[2 * i + j][0, 0, :released].any()
            assert kept._kv._host[2 * i + j][0, 0, :released].any()
    assert freed._kv._host[10][0, 0, :released].any()  # layer 5, global: whole
    freed.truncate(190)  # a forward from 190 views from 160 on: still cached
    assert freed.n_cached == 190 and freed.released == released
    freed.truncate(released)  # a forward from there would read below the views
    assert freed.n_cached == 0 and freed.released == 0
    fresh = OrtEngine(viewed, provider="cpu", threads=2, release_window=True)
    fresh.window_granule = 32
    np.testing.assert_array_equal(freed.forward(ids[:150]), fresh.forward(ids[:150]))
    for t in ids[150:210]:
        np.testing.assert_array_equal(freed.forward([t]), fresh.forward([t]))
