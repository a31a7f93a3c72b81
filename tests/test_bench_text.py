"""`bench --data text`: batches of real text, the same for every system."""

import torch

from bench.text import text_batches


def test_text_batches_are_prose_bytes_the_same_for_each_seed():
    batches = text_batches(64, 2, 3, torch.device("cpu"), seed=0)
    assert [tuple(b.shape) for b in batches] == [(2, 64)] * 3
    ids = torch.cat([b.reshape(-1) for b in batches])
    assert ids.max() < 256 and torch.equal(ids, torch.cat([b.reshape(-1) for b in text_batches(64, 2, 3, "cpu", 0)]))
    text = bytes(ids.tolist()).decode("utf-8", errors="replace")
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text), text[:200]  # mostly words
    assert not torch.equal(ids, torch.cat([b.reshape(-1) for b in text_batches(64, 2, 3, "cpu", 1)]))
