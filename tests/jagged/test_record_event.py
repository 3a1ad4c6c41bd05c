"""`record_event`: torch.Event recorded on the current stream (CUDA only)."""

import pytest
import torch

from freescale.jagged.ops import copy_to_host, record_event, wait_for_copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_record_event_times_and_orders_the_current_stream():
    x = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # recorded on the side stream, not the default one
        start = record_event(timing=True)
        y = x @ x
        end = record_event(timing=True)
    torch.cuda.current_stream().wait_event(end)  # a cuda Stream waits on a torch.Event
    z = y.sum()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0
    host, event = copy_to_host(z.reshape(1))
    wait_for_copy(event, "test")
    assert torch.equal(host.cuda(), z.reshape(1))
