"""Call spies for tests that check what a trainer passed to a function (on the tests' path)."""


def capture_calls(monkeypatch, module, name) -> list:
    """Wrap module.name for the test; keep (args, kwargs, result) of each call, in order."""
    calls, original = [], getattr(module, name)

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def forced_decode(monkeypatch, module, vocab: int, first: int = 2) -> list:
    """Teacher-force `module.sample_next` (the decode loop's sampler): row b's token at
    step t is first + (7 b + 3 t) % (vocab - first), never PAD 0 or EOS 1, whatever the
    logits say; keep each step's logits (B, V). Two code paths decoded this way see the
    same tokens, so their logits compare at a stated tolerance, on any CPU: sampled tokens
    would compare bits (a last-bit difference can move a draw across a CDF boundary)."""
    import torch

    seen = []

    def sample(logits, gen_cfg, eos_id, allow_eos, streams=None):
        seen.append(logits.detach().clone())
        rows = torch.arange(logits.shape[0], device=logits.device)
        return first + (7 * rows + 3 * (len(seen) - 1)) % (vocab - first)

    monkeypatch.setattr(module, "sample_next", sample)
    return seen
