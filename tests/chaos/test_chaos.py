"""The chaos suite's short form, part of the normal test run: one fault of each kind
(`world.FAULTS`) in a seeded order, each followed by the invariants. The long form is
`make chaos` (hundreds of faults, `DELTABOARD_CHAOS_FAULTS`); a failure prints its seed,
and `DELTABOARD_CHAOS_SEED=<seed>` replays it."""

from __future__ import annotations

import os

from tests.chaos.world import FAULTS, chaos_seed, run_chaos


def test_faults_keep_every_invariant(tmp_path):
    faults = int(os.environ.get("DELTABOARD_CHAOS_FAULTS") or len(FAULTS))
    counts = run_chaos(tmp_path, chaos_seed(), faults, print)
    assert all(counts[kind] >= 1 for kind in FAULTS[:faults])
    assert counts["exact_checks"] >= 1 and counts["acks_verified"] >= faults
