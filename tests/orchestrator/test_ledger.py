"""The prompt ledger: each drawn prompt settled once; duplicates and strangers counted."""

from __future__ import annotations

import json

from nonstop.orchestrator.ledger import Ledger
from nonstop.tasks.data import Draw, Example


def _draw(epoch, index):
    return Draw(epoch, Example(index, f"p{index}", "a"))


def test_draw_settle_and_pending_in_draw_order():
    ledger = Ledger()
    for i in (5, 3, 9):
        ledger.draw(_draw(0, i))
    ledger.settle(0, 3, "trained")
    assert [d.example.index for d in ledger.pending()] == [5, 9]
    ledger.settle(0, 5, "uniform_reward")
    assert ledger.report()["outcomes"] == {"trained": 1, "uniform_reward": 1}
    assert ledger.report()["in_flight"] == 1 and ledger.report()["duplicated"] == 0


def test_duplicates_and_unknown_settlements_are_counted_not_hidden():
    ledger = Ledger()
    ledger.draw(_draw(0, 1))
    ledger.settle(0, 1, "trained")
    ledger.settle(0, 1, "trained")  # the same prompt trained twice
    ledger.draw(_draw(0, 1))  # drawn again in the same epoch
    ledger.settle(0, 2, "trained")  # never drawn
    report = ledger.report()
    assert report["duplicated"] == 2 and report["unknown"] == 1
    ledger.draw(_draw(1, 1))  # the next epoch may draw it again
    assert ledger.report()["duplicated"] == 2


def test_state_round_trips_through_json_without_in_flight_draws():
    ledger = Ledger()
    for i in range(4):
        ledger.draw(_draw(0, i))
    ledger.settle(0, 0, "trained")
    restored = Ledger()
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.outcomes == {(0, 0): "trained"} and restored.in_flight == {}
    assert ledger.state_dict()["in_flight"] == [[0, 1], [0, 2], [0, 3]]
