"""Which reply pulls the buffered server uses (fedmvp/federated/reply_pulls.py): one PullMessages request a
poll on Flower's deployed Grid (exercised against a real SuperLink by tests/federated/test_buffered.py), one
pull per awaited message on any other Grid."""

from __future__ import annotations

from flwr.superlink.grid.http_grid import HttpGrid

from fedmvp.federated.reply_pulls import BatchedPulls, SeparatePulls, reply_pulls
from tests.federated.test_aggregation import SiteGrid


def test_the_deployed_grid_is_polled_in_one_request_any_other_one_message_at_a_time():
    batched = reply_pulls(HttpGrid(token="a-token"), 3)  # made without connecting
    separate = reply_pulls(SiteGrid({7: "edge"}), 3)
    try:
        assert type(batched) is BatchedPulls and type(separate) is SeparatePulls
    finally:
        batched.close()
        separate.close()

