"""`ReadyBuckets`: buckets start in index order as their gradients become final, during backward (no processes)."""

import pytest
import torch
from torch import nn

from lightning_smp.overlap import Launched, ReadyBuckets


def _chain(width: int = 4, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _recorder(buckets, log):
    def launch(index):
        grads = [None if p.grad is None else p.grad.clone() for p in buckets[index]]
        log.append(("launch", index))
        return Launched(work=None, complete=lambda: log.append(("complete", index, grads)))

    return launch


def test_buckets_start_during_backward_in_index_order():
    model = _chain()
    # the last layer's parameters are final first in backward: they form bucket 0
    buckets = [list(layer.parameters()) for layer in reversed(model)]
    log: list = []
    ready = ReadyBuckets(buckets, _recorder(buckets, log))
    seen_at_first_layer = []
    # the first layer's weight is the last gradient of backward: count the launches before it
    model[0].weight.register_hook(lambda grad: seen_at_first_layer.append(ready.launched))
    with ready.armed():
        model(torch.randn(3, 4)).sum().backward()
    assert seen_at_first_layer == [3]  # three buckets launched while backward still ran
    assert [entry[:2] for entry in log] == [("launch", i) for i in range(4)]
    ready.finish()
    assert [entry[:2] for entry in log[4:]] == [("complete", i) for i in range(4)]
    for _, index, grads in log[4:]:
        for grad, param in zip(grads, buckets[index], strict=True):
            torch.testing.assert_close(grad, param.grad, rtol=0, atol=0)  # launched on the final gradients


def test_a_bucket_ready_early_waits_for_the_ones_before_it():
    model = _chain()
    buckets = [list(layer.parameters()) for layer in model]  # forward order: bucket 0 is final last
    log: list = []
    ready = ReadyBuckets(buckets, _recorder(buckets, log))
    with ready.armed():
        model(torch.randn(3, 4)).sum().backward()
    # bucket 0 became ready last, so nothing launched before it, then all in order
    assert [entry[:2] for entry in log] == [("launch", i) for i in range(4)]


def test_hooks_count_only_while_armed_and_finish_launches_the_rest():
    model = _chain()
    buckets = [list(layer.parameters()) for layer in reversed(model)]
    log: list = []
    ready = ReadyBuckets(buckets, _recorder(buckets, log))
    model(torch.randn(3, 4)).sum().backward()  # not armed: an earlier microbatch, say
    assert ready.launched == 0
    model[3].weight.grad = None  # a parameter with no gradient this step holds back its bucket and all after
    with ready.armed():
        model[1](model[0](torch.randn(3, 4))).sum().backward()  # a backward reaching only the first two layers
    assert ready.launched == 0
    ready.finish()
    assert [entry[:2] for entry in log] == [("launch", i) for i in range(4)] + [("complete", i) for i in range(4)]
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # the hooks are gone


def test_a_gradient_after_its_bucket_started_is_an_error():
    model = _chain(layers=1)
    buckets = [list(model.parameters())]
    ready = ReadyBuckets(buckets, _recorder(buckets, []))
    with ready.armed():
        model(torch.randn(3, 4)).sum().backward()
        assert ready.launched == 1
        with pytest.raises(RuntimeError, match="after its bucket's reduction had started"):
            model(torch.randn(3, 4)).sum().backward()
