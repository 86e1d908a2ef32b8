"""LR schedules (fairseq's inverse_sqrt, fixed, polynomial_decay) and the Adam builder."""

import math

import pytest
import torch

from attnmt.config import make_config
from attnmt.errors import UserError
from attnmt.optim import (
    AdamConfig,
    FixedConfig,
    FixedSchedule,
    InverseSqrtConfig,
    InverseSqrtSchedule,
    PolynomialDecayConfig,
    PolynomialDecaySchedule,
    build_adam,
)


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def test_inverse_sqrt_equals_formula():
    lr, warm = 7e-4, 4000
    s = InverseSqrtSchedule(InverseSqrtConfig(lr=lr, warmup_updates=warm))
    opt = _opt()
    for n in (0, 1, 100, 3999):
        assert s.step_update(opt, n) == pytest.approx(n * lr / warm)
        assert opt.param_groups[0]["lr"] == pytest.approx(n * lr / warm)
    for n in (4000, 4001, 10000, 100000):
        assert s.step_update(opt, n) == pytest.approx(lr * math.sqrt(warm / n))
    assert s.lr_at(4000) == pytest.approx(lr)  # peak


def test_inverse_sqrt_is_the_papers_schedule_shifted_by_one_update():
    d, warm = 512, 4000
    peak = d ** -0.5 * warm ** -0.5
    assert peak == pytest.approx(7.0e-4, rel=2e-3)
    s = InverseSqrtSchedule(InverseSqrtConfig(lr=peak, warmup_updates=warm))
    for step in (1, 50, 4000, 4001, 20000):
        paper = d ** -0.5 * min(step ** -0.5, step * warm ** -1.5)
        # lr_at(n) is the paper's lrate(n); as in fairseq, update number k runs with lr_at(k - 1)
        assert s.lr_at(step) == pytest.approx(paper, rel=1e-9)


def test_warmup_init_lr_respected_and_no_warmup():
    s = InverseSqrtSchedule(InverseSqrtConfig(lr=1e-3, warmup_updates=10, warmup_init_lr=1e-7))
    assert s.lr_at(0) == pytest.approx(1e-7)
    assert s.lr_at(5) == pytest.approx(1e-7 + 5 * (1e-3 - 1e-7) / 10)
    assert s.lr_at(10) == pytest.approx(1e-3)
    s0 = InverseSqrtSchedule(InverseSqrtConfig(lr=1e-3, warmup_updates=0))
    assert s0.lr_at(0) == pytest.approx(1e-3)
    assert s0.lr_at(4) == pytest.approx(1e-3 / 2)


def test_reset_moves_the_schedule_start():
    s = InverseSqrtSchedule(InverseSqrtConfig(lr=1e-3, warmup_updates=10))
    s.load_state_dict({"start_update": 100})
    opt = _opt()
    assert s.step_update(opt, 105) == pytest.approx(5e-4)
    assert s.state_dict() == {"start_update": 100, "start_time": 0.0}


def test_fixed():
    s = FixedSchedule(FixedConfig(lr=3e-4))
    assert [s.lr_at(n) for n in (0, 1, 10 ** 6)] == [3e-4] * 3


def test_polynomial_decay_equals_fairseqs_formula():
    lr, warm, total, end = 2e-3, 10, 110, 1e-5
    for power in (1.0, 2.0):
        s = PolynomialDecaySchedule(PolynomialDecayConfig(lr=lr, warmup_updates=warm, total_num_update=total,
                                                          end_learning_rate=end, power=power))
        assert s.lr_at(0) == pytest.approx(lr / warm)  # fairseq starts the warm-up at lr / warmup_updates
        assert s.lr_at(4) == pytest.approx(4 * lr / warm)
        assert s.lr_at(warm) == pytest.approx(lr)  # the peak
        assert s.lr_at(60) == pytest.approx(end + (lr - end) * 0.5 ** power)  # half-way through the decay
        assert s.lr_at(total) == s.lr_at(10 * total) == pytest.approx(end)
    linear = PolynomialDecaySchedule(PolynomialDecayConfig(lr=1e-3, total_num_update=100))
    assert [linear.lr_at(n) for n in (0, 25, 99)] == pytest.approx([1e-3, 7.5e-4, 1e-5])


def test_polynomial_decay_with_minutes_follows_the_further_along_of_updates_and_clock():
    lr, warm, total = 1e-3, 10, 110
    s = PolynomialDecaySchedule(PolynomialDecayConfig(lr=lr, warmup_updates=warm, total_num_update=total,
                                                      total_train_minutes=10))
    opt = _opt()
    assert s.step_update(opt, 5, train_time=200.0) == pytest.approx(5 * lr / warm)  # the warm-up counts updates
    # update 60 is half-way through the decay; 6 of 10 minutes stand for update 66
    assert s.step_update(opt, 60, train_time=240.0) == pytest.approx(lr * 0.5)
    assert s.step_update(opt, 60, train_time=360.0) == pytest.approx(lr * (1 - 56 / 100))
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.44)
    assert s.step_update(opt, 90) == pytest.approx(lr * 0.2)  # no reading: the last clock (6 minutes) stands
    assert s.step_update(opt, 61, train_time=600.0) == 0.0  # the minutes are up: annealed
    no_clock = PolynomialDecaySchedule(PolynomialDecayConfig(lr=lr, warmup_updates=warm, total_num_update=total))
    assert no_clock.step_update(opt, 60, train_time=600.0) == pytest.approx(lr * 0.5)  # off by default


def test_a_restarted_schedule_counts_updates_and_minutes_from_the_restart():
    s = PolynomialDecaySchedule(PolynomialDecayConfig(lr=1e-3, total_num_update=100, total_train_minutes=10))
    opt = _opt()
    s.step_update(opt, 400, train_time=3000.0)
    s.restart(400)
    assert s.step_update(opt, 400, train_time=3000.0) == pytest.approx(1e-3)  # the clock's first reading
    assert s.step_update(opt, 410, train_time=3300.0) == pytest.approx(0.5e-3)  # 5 minutes on: update 50
    assert s.state_dict() == {"start_update": 400, "start_time": 3000.0}
    resumed = PolynomialDecaySchedule(PolynomialDecayConfig(lr=1e-3, total_num_update=100, total_train_minutes=10))
    resumed.load_state_dict(s.state_dict())
    assert resumed.step_update(opt, 410, train_time=3300.0) == pytest.approx(0.5e-3)
    old = PolynomialDecaySchedule(PolynomialDecayConfig(lr=1e-3, total_num_update=100, total_train_minutes=10))
    old.load_state_dict({"start_update": 0})  # a checkpoint written before the schedule kept its start time
    assert old.step_update(opt, 10, train_time=300.0) == pytest.approx(0.5e-3)


def test_polynomial_decay_refuses_a_decay_that_ends_before_the_warmup():
    with pytest.raises(UserError, match="--total-num-update 10 must exceed --warmup-updates 10"):
        make_config(PolynomialDecayConfig, {"total_num_update": 10, "warmup_updates": 10},
                    what="--lr-scheduler polynomial_decay")


def test_adam_defaults_are_the_papers_and_weight_decay_is_decoupled():
    cfg = AdamConfig()
    assert cfg.adam_betas == (0.9, 0.98) and cfg.adam_eps == 1e-9
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_adam(make_config(AdamConfig, {"weight_decay": 0.1}), [p], lr=0.5)
    assert isinstance(opt, torch.optim.AdamW)
    p.grad = torch.zeros(3)
    opt.step()  # zero gradient: only decoupled decay moves the weights, by lr * wd
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 0.5 * 0.1))


def test_bad_values_are_user_errors():
    with pytest.raises(UserError, match="adam-betas"):
        make_config(AdamConfig, {"adam_betas": "(0.9, 1.5)"})
    with pytest.raises(UserError, match="expected 2 values"):
        make_config(AdamConfig, {"adam_betas": "(0.9,)"})
    with pytest.raises(UserError, match="--lr"):
        make_config(InverseSqrtConfig, {"lr": -1})
