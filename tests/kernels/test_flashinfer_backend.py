"""FlashInfer backend: a clear error without CUDA, exact page tables, and parity with torch.

Three layers of checks:
- always (CPU): constructing the backend here raises FlashInferUnavailableError; the metadata ->
  CSR page-table translation gives exact block ids;
- always (CPU): the backend driven by a stand-in flashinfer module that implements FlashInfer's
  documented paged semantics in torch matches the torch backend, and plans once per step;
- CUDA only: the real flashinfer kernels match the torch backend within fp16/bf16 tolerance.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from halfmoon.kernels.attention import get_backend
from halfmoon.kernels.flashinfer_backend import (
    FlashInferAttentionBackend,
    FlashInferUnavailableError,
    decode_page_table,
    page_table,
    prefill_page_table,
    prefill_qo_indptr,
)
from halfmoon.kernels.torch_backend import TorchAttentionBackend
from tests.kernels.fake_flashinfer import fake_flashinfer
from tests.kernels.paged_scene import MIXED, Scene, _decode_batch, _prefill, make_scene, run_backend

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="flashinfer backend needs CUDA; this machine has none"
)


# ---------------------------------------------------------------- CPU: the error a user sees


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_constructor_without_cuda_raises_helpful_error() -> None:
    with pytest.raises(FlashInferUnavailableError) as e:
        FlashInferAttentionBackend()
    msg = str(e.value)
    assert "CUDA" in msg and "pip install 'halfmoon[gpu]'" in msg and "'torch'" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_registry_raises_the_same_error() -> None:
    with pytest.raises(FlashInferUnavailableError, match=r"pip install 'halfmoon\[gpu\]'"):
        get_backend("flashinfer")


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(FlashInferUnavailableError, match="not installed") as e:
        FlashInferAttentionBackend()
    assert "pip install 'halfmoon[gpu]'" in str(e.value)
    assert isinstance(e.value.__cause__, ImportError)


def test_importing_the_backend_does_not_import_flashinfer() -> None:
    # A fresh interpreter: this one may have imported flashinfer for another test already.
    probe = "import sys, halfmoon.kernels.flashinfer_backend; print('flashinfer' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------- CPU: metadata -> page tables


def test_page_table_exact_block_ids() -> None:
    # block_size 4: request A has 9 keys over blocks [7, 2, 5]; B has 4 keys in block [3].
    pt = page_table([torch.tensor([7, 2, 5]), torch.tensor([3])], torch.tensor([9, 4]), 4)
    assert pt.indptr.tolist() == [0, 3, 4]
    assert pt.indices.tolist() == [7, 2, 5, 3]
    assert pt.last_page_len.tolist() == [1, 4]
    assert {pt.indptr.dtype, pt.indices.dtype, pt.last_page_len.dtype} == {torch.int32}


def test_decode_page_table_ignores_padding() -> None:
    dec = _decode_batch([[7, 2, 5], [3], [6, 1]], [9, 4, 5], block_size=4)
    pt = decode_page_table(dec, 4)
    assert pt.indptr.tolist() == [0, 3, 4, 6]
    assert pt.indices.tolist() == [7, 2, 5, 3, 6, 1]
    assert pt.last_page_len.tolist() == [1, 4, 1]


def test_decode_page_table_without_mask_uses_full_width() -> None:
    dec = _decode_batch([[4, 0], [1, 3]], [6, 6], block_size=4)
    assert dec.mask is None
    pt = decode_page_table(dec, 4)
    assert pt.indices.tolist() == [4, 0, 1, 3]
    assert pt.last_page_len.tolist() == [2, 2]


def test_prefill_tables_cover_cached_prefix_and_chunk() -> None:
    segs = [_prefill([4, 9], 3, 2, q_start=2, block_size=4),  # 5 keys, 2 new queries
            _prefill([1], 0, 4, q_start=4, block_size=4)]
    pt = prefill_page_table(segs, 4)
    assert pt.indptr.tolist() == [0, 2, 3]
    assert pt.indices.tolist() == [4, 9, 1]
    assert pt.last_page_len.tolist() == [1, 4]
    assert prefill_qo_indptr(segs).tolist() == [0, 2, 6]


def test_non_contiguous_prefill_chunks_are_rejected() -> None:
    segs = [_prefill([0], 0, 2, q_start=0, block_size=4),
            _prefill([1], 0, 2, q_start=3, block_size=4)]  # row 2 belongs to nobody
    with pytest.raises(ValueError, match="not contiguous"):
        prefill_qo_indptr(segs)


def test_block_table_too_short_for_its_context_is_rejected() -> None:
    with pytest.raises(ValueError, match="shorter"):
        page_table([torch.tensor([5])], torch.tensor([5]), 4)


# ---------------------------------------------------------------- CPU: stand-in flashinfer module


@pytest.mark.parametrize("step", [
    MIXED,
    {"decode_ctx": [5, 5, 5], "prefills": []},  # equal lengths: no decode mask
    {"decode_ctx": [], "prefills": [(9, 3), (0, 1)]},
    {"decode_ctx": [1], "prefills": [(4, 4)]},  # chunk ends exactly on a block boundary
])
def test_translation_matches_torch_backend(step: dict[str, Any]) -> None:
    scene = make_scene(**step, seed=3)
    expected = run_backend(TorchAttentionBackend(), scene, scene.cache.clone())
    cache = scene.cache.clone()
    got = run_backend(FlashInferAttentionBackend(module=fake_flashinfer()), scene, cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_is_the_shared_scatter() -> None:
    scene = make_scene(**MIXED, seed=4)
    a, b = scene.cache.clone(), scene.cache.clone()
    FlashInferAttentionBackend(module=fake_flashinfer()).write_kv(
        a, scene.k, scene.v, scene.meta.slot_mapping)
    TorchAttentionBackend().write_kv(b, scene.k, scene.v, scene.meta.slot_mapping)
    assert torch.equal(a, b)


def test_plans_once_per_step_not_per_layer() -> None:
    fi = fake_flashinfer()
    backend = FlashInferAttentionBackend(module=fi)
    step1 = make_scene(**MIXED, seed=1)
    for _ in range(3):  # three layers share the step's metadata object
        run_backend(backend, step1, step1.cache.clone())
    assert fi.plan_log == ["decode", "prefill"]
    step2 = make_scene(decode_ctx=[3, 7], prefills=[], seed=2)  # a new step: planned again
    for _ in range(2):
        run_backend(backend, step2, step2.cache.clone())
    assert fi.plan_log == ["decode", "prefill", "decode"]
    assert {window for _, window, _ in fi.plan_params} == {-1}, "window 0 plans no window"


def _run(backend: Any, scene: Scene, cache: torch.Tensor, window: int,
         scale: float | None) -> torch.Tensor:
    out = torch.full((scene.meta.num_tokens, scene.q.shape[1] * scene.q.shape[2]), float("nan"))
    backend.forward(scene.q, cache, scene.meta, out, window=window, scale=scale)
    return out


def test_window_and_scale_reach_plan_and_match_torch_backend() -> None:
    """A Gemma 3 step: local layers (window 5) and global ones (none) interleaved, one scale.
    One plan per wrapper and distinct (window, scale) a step, whatever the layer order."""
    fi = fake_flashinfer()
    backend = FlashInferAttentionBackend(module=fi)
    scene = make_scene(decode_ctx=[9, 1, 13, 30], prefills=[(0, 12), (5, 6), (20, 1)], seed=5)
    cache = scene.cache.clone()
    backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    torch_cache = cache.clone()
    for window in (5, 5, 0, 5, 0, 5):  # layers
        got = _run(backend, scene, cache, window, 0.3)
        want = _run(TorchAttentionBackend(), scene, torch_cache, window, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fi.plan_params == [("decode", 4, 0.3), ("prefill", 4, 0.3),
                              ("decode", -1, 0.3), ("prefill", -1, 0.3)]
    windowed = _run(backend, scene, cache, 5, 0.3)
    assert not torch.allclose(windowed, _run(backend, scene, cache, 0, 0.3), atol=1e-3)
    step2 = make_scene(decode_ctx=[3, 7], prefills=[], seed=2)  # a new step: planned again
    _run(backend, step2, step2.cache.clone(), 5, 0.3)
    assert fi.plan_params[-1] == ("decode", 4, 0.3) and len(fi.plan_params) == 5


# ---------------------------------------------------------------- CUDA: the real kernels


@needs_cuda
@pytest.mark.gpu
class TestOnCuda:
    @pytest.fixture(autouse=True)
    def _flashinfer(self) -> None:
        pytest.importorskip("flashinfer", reason="needs flashinfer: pip install 'halfmoon[gpu]'")

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    @pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
        (8, 2, 64, 16),  # group 4: CUDA-core decode
        (32, 4, 128, 16),  # group 8: tensor-core decode
        (4, 4, 128, 32),
    ])
    def test_matches_torch_backend(self, dtype: torch.dtype, heads: int, kv_heads: int,
                                   head_dim: int, block_size: int) -> None:
        step = {"decode_ctx": [40, 1, 17, 130], "prefills": [(0, 37), (50, 20), (16, 1), (0, 5)]}
        scene = make_scene(**step, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, device="cuda", seed=7)
        got = run_backend(FlashInferAttentionBackend(), scene, scene.cache.clone())
        ref_scene = Scene(scene.q.float(), scene.k.float(), scene.v.float(),
                          scene.cache.float(), scene.meta)
        expected = run_backend(TorchAttentionBackend(), ref_scene, ref_scene.cache.clone())
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)

    @pytest.mark.parametrize("window", [1, 8, 37])
    def test_window_and_scale_match_torch_backend(self, window: int) -> None:
        step = {"decode_ctx": [40, 1, 17, 130], "prefills": [(0, 37), (50, 20), (16, 1), (0, 5)]}
        scene = make_scene(**step, heads=8, kv_heads=2, head_dim=128, block_size=16,
                           dtype=torch.bfloat16, device="cuda", seed=8)
        backend, cache = FlashInferAttentionBackend(), scene.cache.clone()
        backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
        got = torch.empty(scene.meta.num_tokens, 8 * 128, dtype=torch.bfloat16, device="cuda")
        backend.forward(scene.q, cache, scene.meta, got, window=window, scale=0.05)
        ref_scene = Scene(scene.q.float(), scene.k.float(), scene.v.float(),
                          scene.cache.float(), scene.meta)
        ref_cache = ref_scene.cache.clone()
        ref = TorchAttentionBackend()
        ref.write_kv(ref_cache, ref_scene.k, ref_scene.v, scene.meta.slot_mapping)
        want = torch.empty(scene.meta.num_tokens, 8 * 128, device="cuda")
        ref.forward(ref_scene.q, ref_cache, scene.meta, want, window=window, scale=0.05)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)

    def test_write_kv_matches_torch_backend(self) -> None:
        scene = make_scene(**MIXED, dtype=torch.float16, device="cuda", seed=5)
        a, b = scene.cache.clone(), scene.cache.clone()
        FlashInferAttentionBackend().write_kv(a, scene.k, scene.v, scene.meta.slot_mapping)
        TorchAttentionBackend().write_kv(b, scene.k, scene.v, scene.meta.slot_mapping)
        assert torch.equal(a, b)

    def test_a_head_dim_the_kernels_lack_is_a_clear_error(self) -> None:
        # FlashInfer 0.7.2's paged prefill fails at run time on head_dim 16 ("Invalid
        # configuration", seen on an H200): the backend refuses it before planning.
        scene = make_scene(**MIXED, head_dim=16, dtype=torch.bfloat16, device="cuda", seed=9)
        with pytest.raises(ValueError, match=r"head_dim \[64, 128, 256\].*has 16: use --attention-backend torch"):
            run_backend(FlashInferAttentionBackend(), scene, scene.cache.clone())

    def test_plans_once_per_step(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import flashinfer  # noqa: PLC0415

        calls: list[str] = []
        for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
            cls = getattr(flashinfer, name)
            original = cls.plan

            def counted(self: Any, *a: Any, _orig: Any = original, _n: str = name,
                        **kw: Any) -> Any:
                calls.append(_n)
                return _orig(self, *a, **kw)

            monkeypatch.setattr(cls, "plan", counted)
        backend = FlashInferAttentionBackend()
        scene = make_scene(**MIXED, head_dim=64, dtype=torch.bfloat16, device="cuda", seed=9)
        for _ in range(4):
            run_backend(backend, scene, scene.cache.clone())
        assert sorted(calls) == ["BatchDecodeWithPagedKVCacheWrapper",
                                 "BatchPrefillWithPagedKVCacheWrapper"]
