"""The planner's flags (`--planner off|advise|act`, its interval, window and pool bounds), one
table for `halfmoon serve` (nested in the cluster's flags: `ClusterConfig.planner`) and
`halfmoon sim`. Every flag has its HALFMOON_* twin (cli/flags.py) and a Helm value
(`planner.*`, helm/halfmoon/values.yaml).

This module imports no torch: `halfmoon sim` adds the flags without loading an engine.
"""

from __future__ import annotations

import argparse

from halfmoon.cli.flags import Component, Flag, add_flags, build
from halfmoon.conductor.planner import MODES, PlannerConfig

PLANNER = Component(
    PlannerConfig, "planner: re-balances the prefill and decode pools at run time (docs/OPERATIONS.md, Planner)",
    flags={
        "mode": Flag("planner", choices=MODES,
                     help="off (no planner); advise (default: decisions logged, shown on the dashboard and in "
                          "/metrics, nothing changes); act (the Conductor flips, adds and removes workers)"),
        "interval_s": Flag("planner-interval-s", help="seconds between two decisions"),
        "window_s": Flag("planner-window-s", help="seconds of recent traffic each decision replays"),
        "min_prefill": Flag(help="fewest prefill workers the planner keeps"),
        "max_prefill": Flag(help="most prefill workers the planner runs (default: the total's bound)"),
        "min_decode": Flag(help="fewest decode workers the planner keeps"),
        "max_decode": Flag(help="most decode workers the planner runs (default: the total's bound)"),
        "min_workers": Flag("planner-min-workers",
                            help="fewest workers in all (default: the total at start, so it only flips roles)"),
        "max_workers": Flag("planner-max-workers",
                            help="most workers in all (default: the total at start; above it, `act` adds workers)"),
        "min_gain": Flag("planner-min-gain",
                         help="predicted goodput gain (relative: 0.1 = 10%) a move needs"),
        "confirm": Flag("planner-confirm", help="decisions in a row that must advise a move before it is made"),
        "judge_s": Flag("planner-judge-s", help="seconds after a move that it is judged (rolled back if worse)"),
        "rollback_margin": Flag("planner-rollback-margin",
                                help="drop in SLO attainment (0-1) after a move that rolls it back"),
        "cooldown_s": Flag("planner-cooldown-s", help="seconds a rolled-back split is not advised again"),
        "drain_s": Flag("planner-drain-s",
                        help="seconds a worker leaving its pool lets its requests finish before the rest "
                             "migrate (nothing is lost either way)"),
    })


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    """The planner's flags, one argument group (their defaults: PlannerConfig's, or HALFMOON_*)."""
    add_flags(parser, PLANNER)


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    """The PlannerConfig of parsed flags (a bad value: ConfigError naming it)."""
    return build(PLANNER, args)
