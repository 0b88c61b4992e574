"""`halfmoon sim` with no shape or tier flag simulates the cluster `halfmoon serve` starts with no
flags: both command lines parsed, their configs compared field by field, for every built-in
profile's model and this machine's (conductor/serve_defaults.py owns the values)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from halfmoon.cli.components import ADMISSION, CLUSTER, PROFILE_ENGINE, SERVE_ENGINE
from halfmoon.cli.flags import build
from halfmoon.cli.main import parse_args
from halfmoon.cli.sim import sim_config
from halfmoon.conductor.serve_defaults import TierTokens, serve_cluster, serve_engine, tier_tokens
from halfmoon.engine.config import EngineConfig
from halfmoon.sim.builtin import load as load_profile
from halfmoon.sim.builtin import names
from halfmoon.sim.cluster import SimConfig, serve_config, serve_shape
from tests.sim.support import sample_trace
from halfmoon.transport.config import TransportConfig

# layers x (K, V) x KV heads x head dim x bytes of serve's KV dtype (`auto`, as resolved on this
# machine): this machine's model as served
SMOLLM2_SERVED = 30 * 2 * 3 * 64 * torch.empty(0, dtype=serve_engine().torch_dtype).element_size()


def serve_defaults() -> tuple[EngineConfig, int, int]:
    """The engine, prefill and decode counts of `halfmoon serve` parsed with no flags."""
    args = parse_args(["serve"])
    engine = build(SERVE_ENGINE, args)
    cluster = build(CLUSTER, args, engine=engine, transport=TransportConfig(), model_id="m")
    return engine, cluster.prefill, cluster.decode


def test_sim_steps_prefill_workers_as_serve_does() -> None:
    """A prefill worker's prompts a step: serve's flag and the simulator's, one default."""
    args = parse_args(["serve"])
    cluster = build(CLUSTER, args, engine=build(SERVE_ENGINE, args), transport=TransportConfig(), model_id="m")
    sim = sim_config(parse_args(["sim", "--trace", str(sample_trace()), "--profile", names()[0]]), SMOLLM2_SERVED)[0]
    assert cluster.prefill_max_seqs == sim.prefill_max_seqs == SimConfig().prefill_max_seqs == 1
    assert cluster.prefill_seqs("prefill") == 1 and cluster.prefill_seqs("decode") is None
    engines = {s.role: s.engine for s in cluster.specs(None)}
    assert engines["prefill"].max_prefill_seqs == 1 and engines["decode"].max_prefill_seqs is None
    assert engines["prefill"].max_num_seqs == engines["decode"].max_num_seqs  # decode batches untouched


@pytest.mark.parametrize("kv_bytes_per_token", [SMOLLM2_SERVED, *(load_profile(n).kv_bytes_per_token for n in names())])
def test_sim_without_flags_is_serve_without_flags(kv_bytes_per_token: int) -> None:
    engine, prefill, decode = serve_defaults()
    config, (device, host) = sim_config(parse_args(["sim", "--trace", str(sample_trace()), "--profile", names()[0]]),
                                        kv_bytes_per_token)
    tiers = tier_tokens(engine, kv_bytes_per_token)
    assert (config.prefill, config.decode, config.colocated) == (prefill, decode, False)
    assert (config.block_size, config.chunk, config.max_seqs) == (engine.block_size, engine.max_num_batched_tokens,
                                                                   engine.max_num_seqs)
    assert TierTokens(config.device_tokens, config.host_tokens, config.disk_tokens) == tiers
    assert (device, host) == ((tiers.device,), (tiers.host,))
    assert tiers.host > 0 and tiers.disk == 0  # serve: a host tier, no disk tier (it needs a directory)
    assert config.admission == build(ADMISSION, parse_args(["serve"]))
    assert config == serve_config(kv_bytes_per_token)


def test_flags_given_to_sim_override_serves_values() -> None:
    args = parse_args(["sim", "--trace", str(sample_trace()), "--profile", names()[0], "--host-tokens", "0,1024",
                       "--device-tokens", "4096", "--block-size", "32", "--prefill", "2"])
    config, (device, host) = sim_config(args, SMOLLM2_SERVED)
    assert (config.device_tokens, config.host_tokens, config.block_size, config.prefill) == (4096, 0, 32, 2)
    assert (device, host) == ((4096,), (0, 1024))
    # a block size changes how serve's GiB cut into tokens (whole blocks), as it would live
    assert sim_config(parse_args(["sim", "--trace", str(sample_trace()), "--profile", names()[0], "--block-size",
                                  "48"]), SMOLLM2_SERVED)[0].device_tokens == 2**30 // (48 * SMOLLM2_SERVED) * 48


def test_simconfigs_own_defaults_are_serves_where_no_model_is_needed() -> None:
    engine, prefill, decode = serve_defaults()
    plain = SimConfig()
    assert (plain.prefill, plain.decode, plain.block_size, plain.chunk, plain.max_seqs) == (
        prefill, decode, engine.block_size, engine.max_num_batched_tokens, engine.max_num_seqs)


def test_a_cost_model_profiled_without_flags_is_of_the_engine_serve_runs() -> None:
    """`halfmoon sim --cost-model` reads a `halfmoon profile` JSON: with no flags, profile measures
    serve's precision (`--dtype auto`, resolved alike), so the simulated workers cost what serve's
    do, their tiers in that dtype's KV bytes; `generate` keeps the token-exact fp32."""
    profiled = build(PROFILE_ENGINE, parse_args(["profile"]))
    served, _, _ = serve_defaults()
    assert (profiled.dtype, profiled.quantization) == (served.dtype, served.quantization) == (
        serve_engine().dtype, serve_engine().quantization)
    assert profiled.kv_tag == served.kv_tag
    assert parse_args(["profile"]).dtype == parse_args(["serve"]).dtype == "auto"
    assert build(PROFILE_ENGINE, parse_args(["profile", "--dtype", "float32"])).kv_tag == "float32"
    assert parse_args(["generate", "--prompt", "x"]).dtype == "float32"


def test_sims_serve_shape_is_serves_cluster_but_for_the_dtype_it_does_not_resolve() -> None:
    """`sim.cluster.serve_shape` skips resolving serve's `auto` dtype (it imports torch, seconds
    before every `halfmoon sim`): every other field is `serve_cluster()`'s."""
    served, shape = serve_cluster(), serve_shape()
    assert shape.engine.dtype == EngineConfig().dtype
    assert dataclasses.replace(shape, engine=dataclasses.replace(shape.engine, dtype=served.engine.dtype)) == served
