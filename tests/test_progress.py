"""LayerProgress: one word per load, readable from any process, reused safely."""

import numpy as np
import pytest

from hicache.transfers import FAILED, LayerProgress, LoadFailed


def table(capacity=4, layers=3) -> LayerProgress:
    return LayerProgress(np.zeros(capacity, dtype=np.int64), layers)


def test_layers_appear_in_order_and_only_for_their_ticket():
    p = table()
    assert p.layers_done(5) == 0  # not started
    p.publish(5, 1)
    assert p.layers_done(5) == 1
    assert p.layers_done(1) == 3  # word 1 now belongs to ticket 5 > 1: ticket 1 finished
    assert p.layers_done(9) == 0  # the same word, a later ticket: not started
    assert p.wait_layer(5, 0, timeout=0)
    assert not p.wait_layer(5, 1, timeout=0.01)
    p.publish(5, 3)
    assert p.wait_layer(5, 2, timeout=0) and p.can_start(9)


def test_a_word_is_reused_only_after_its_load_finished():
    p = table()
    p.publish(2, 1)
    assert not p.can_start(6)  # ticket 2 still copying in word 2
    p.publish(2, 3)
    assert p.can_start(6)


def test_a_failed_load_raises_for_its_reader():
    p = table()
    p.publish(3, FAILED)
    with pytest.raises(LoadFailed):
        p.wait_layer(3, 0, timeout=1)
    assert p.can_start(7)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        LayerProgress(np.zeros(4, dtype=np.int32), 3)
    with pytest.raises(ValueError):
        LayerProgress(np.zeros(4, dtype=np.int64), 0)
    with pytest.raises(ValueError):
        table().wait_layer(1, 3)
