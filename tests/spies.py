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
