"""`halfmoon bench engine --device cuda` on a machine without a GPU: a clear exit, no fallback
to a CPU run (the figures would be mislabeled)."""

from __future__ import annotations

import pytest
import torch

from halfmoon.bench.engine_bench import main, parse_args


def test_device_and_backend_flags_parse() -> None:
    args = parse_args(["--device", "cuda", "--attention-backend", "flashinfer", "--dtype", "bfloat16"])
    assert (args.device, args.attention_backend, args.dtype) == ("cuda", "flashinfer", "bfloat16")
    assert parse_args([]).device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_cuda_bench_refuses_without_a_gpu() -> None:
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--device", "cuda", "--quick"])
