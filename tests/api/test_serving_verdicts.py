from __future__ import annotations

from api.serving_verdicts import ServingVerdicts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_model_found_serving_is_taken_to_serve_for_the_ttl_only() -> None:
    clock = Clock()
    verdicts = ServingVerdicts(1.0, clock)
    assert not verdicts.fresh("m")  # never asked: ask the database
    verdicts.found("m")
    clock.now += 0.9
    assert verdicts.fresh("m") and not verdicts.fresh("other")
    clock.now += 0.1
    assert not verdicts.fresh("m")  # ask again
    verdicts.found("m")
    assert verdicts.fresh("m")


def test_a_ttl_of_zero_remembers_nothing() -> None:
    verdicts = ServingVerdicts(0.0, Clock())
    verdicts.found("m")
    assert not verdicts.fresh("m")


def test_an_instance_deleted_makes_every_model_asked_for_again() -> None:
    verdicts = ServingVerdicts(1.0, Clock())
    verdicts.found("m", slots=4)
    verdicts.found("n", "embed")
    verdicts.forget()
    assert not verdicts.fresh("m") and not verdicts.fresh("n", "embed")
    assert verdicts.slots("m") is None
