"""The loop's stop / validate / save decision after each update, over a table of cases."""

from __future__ import annotations

import pytest

from attnmt.training.config import TrainConfig
from attnmt.training.decisions import AfterUpdate, Decision, after_update, after_validation, already_done

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


CASES = [
    # (what, config, state, can_validate, expected (stop, validate, save))
    ("mid-epoch, nothing due", {}, AfterUpdate(7, 1, False), True, (None, False, [])),
    ("epoch end: validate, epoch + last checkpoint", {}, AfterUpdate(10, 1, True), True,
     (None, True, ["checkpoint1.pt", LAST])),
    ("epoch end without validation sets", {}, AfterUpdate(10, 1, True), False, (None, False, ["checkpoint1.pt", LAST])),
    ("epoch end, --validate-interval 2, odd epoch", {"validate_interval": 2}, AfterUpdate(10, 1, True), True,
     (None, False, ["checkpoint1.pt", LAST])),
    ("epoch end, --save-interval 2, odd epoch", {"save_interval": 2}, AfterUpdate(10, 1, True), True,
     (None, True, [])),
    ("--no-epoch-checkpoints still saves last", {"no_epoch_checkpoints": True}, AfterUpdate(10, 3, True), True,
     (None, True, [LAST])),
    ("--save-interval-updates hit", {"save_interval_updates": 5}, AfterUpdate(15, 2, False), True,
     (None, False, ["checkpoint_2_15.pt", LAST])),
    ("--save-interval-updates hit at an epoch end: the epoch name only", {"save_interval_updates": 5},
     AfterUpdate(15, 2, True), True, (None, True, ["checkpoint2.pt", LAST])),
    ("--save-interval-updates hit by an empty update", {"save_interval_updates": 5},
     AfterUpdate(15, 2, False, stepped=False), True, (None, False, [])),
    ("--save-interval-minutes due", {"save_interval_minutes": 1.0}, AfterUpdate(8, 1, False, minutes_due=True), True,
     (None, False, ["checkpoint_1_8.pt", LAST])),
    ("--validate-interval-updates hit", {"validate_interval_updates": 4}, AfterUpdate(8, 1, False), True,
     (None, True, [])),
    ("--max-update reached mid-epoch: validate and save last", {"max_update": 8}, AfterUpdate(8, 1, False), True,
     ("max_update", True, [LAST])),
    ("--max-epoch reached", {"max_epoch": 2}, AfterUpdate(20, 2, True), True,
     ("max_epoch", True, ["checkpoint2.pt", LAST])),
    ("--max-epoch not yet", {"max_epoch": 3}, AfterUpdate(20, 2, True), True, (None, True, ["checkpoint2.pt", LAST])),
    ("time up", {"max_time_minutes": 1.0}, AfterUpdate(3, 1, False, time_up=True), True, ("max_time", True, [LAST])),
    ("preempted: save last, no validation", {}, AfterUpdate(3, 1, False, preempted=True), True,
     ("preempted", False, [LAST])),
    ("max update wins over preemption", {"max_update": 3}, AfterUpdate(3, 1, False, preempted=True), True,
     ("max_update", True, [LAST])),
]


@pytest.mark.parametrize("what,options,state,can_validate,expected", CASES, ids=[c[0] for c in CASES])
def test_after_update(what, options, state, can_validate, expected):
    d = after_update(cfg(**options), state, can_validate)
    assert (d.stop, d.validate, d.save) == expected


@pytest.mark.parametrize("before,improved,bad,patience,expected", [
    (Decision(None, True, []), True, 0, -1, (None, [BEST, LAST])),
    (Decision(None, True, ["checkpoint1.pt", LAST]), True, 0, -1, (None, [BEST, "checkpoint1.pt", LAST])),
    (Decision(None, True, []), False, 1, -1, (None, [])),
    (Decision(None, True, []), False, 2, 2, ("patience", [LAST])),
    (Decision(None, True, []), False, 1, 2, (None, [])),
    (Decision("max_update", True, [LAST]), False, 5, 2, ("max_update", [LAST])),
])
def test_after_validation(before, improved, bad, patience, expected):
    d = after_validation(cfg(patience=patience), before, improved, bad)
    assert (d.stop, d.save) == expected


@pytest.mark.parametrize("options,state,expected", [
    ({}, (0, 1, False, 0.0), None),
    ({"max_update": 10}, (10, 2, False, 5.0), "max_update"),
    ({"max_epoch": 2}, (10, 2, True, 5.0), "max_epoch"),
    ({"max_epoch": 2}, (10, 2, False, 5.0), None),
    ({"max_time_minutes": 1.0}, (10, 2, False, 60.0), "max_time"),
])
def test_already_done(options, state, expected):
    assert already_done(cfg(**options), *state) == expected
