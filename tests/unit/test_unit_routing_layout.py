"""The routing a rollout server answers (serving/policy.py routing_rows) comes back in the
trainer's left-padded layout (generation/server.py routing_of): each real prompt token and
each response token keeps its experts, padding and unrouted tokens are -1, whatever the
server's own padding was."""

import pytest
import torch

from rlhf_dist.errors import ServerError
from rlhf_dist.generation.server import routing_of
from rlhf_dist.serving.policy import routing_rows


def test_served_routing_round_trips_into_the_trainers_layout():
    L, k, T = 2, 2, 4
    server_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])  # the server padded to 4
    lengths = [3, 1]  # real response tokens per row
    routing = torch.arange(2 * (4 + T) * L * k).reshape(2, 4 + T, L, k)
    rows = routing_rows(routing, server_mask, lengths)
    assert [len(r) for r in rows] == [2 + 3, 4 + 1]
    trainer_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]])  # padded to 5
    got = routing_of([("http://a", {"routing": rows[:1]}), ("http://b", {"routing": rows[1:]})],
                     trainer_mask, T)  # fmt: skip
    assert got.shape == (2, 5 + T, L, k)
    assert torch.equal(got[0, 3:5], routing[0, 2:4])  # prompt tokens
    assert torch.equal(got[0, 5:8], routing[0, 4:7])  # response tokens
    assert torch.equal(got[1, 1:5], routing[1, 0:4]) and torch.equal(got[1, 5], routing[1, 4])
    assert (got[0, :3] == -1).all() and (got[0, 8:] == -1).all()
    assert (got[1, :1] == -1).all() and (got[1, 6:] == -1).all()


def test_an_answer_without_routing_is_a_server_error_naming_the_server():
    with pytest.raises(ServerError, match=r"^rollout server http://a: no routing"):
        routing_of([("http://a", {"responses": [[1]]})], torch.ones(1, 2, dtype=torch.long), 1)
