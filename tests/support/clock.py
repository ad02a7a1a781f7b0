"""A hand-driven clock for the pure parts (scheduler, policy, driver, ledgers): the
tests move `now`; `sleep` advances it and records what was slept."""


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
