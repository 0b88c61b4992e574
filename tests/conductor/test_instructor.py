"""instructor (a real third-party package, unmodified) against the served SmolLM2: its TOOLS mode
(a named function tool: the grammar of the model's tool-call format) and its JSON_SCHEMA mode
(response_format json_schema) both return a validated pydantic model on every try, streaming
partial objects too."""

from __future__ import annotations

from typing import Literal

import instructor
import openai
import pydantic
import pytest

from tests.conductor.conftest import MODEL, RunningApi

pytestmark = [pytest.mark.slow]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=40)
    climate: Literal["cold", "mild", "hot"]


def client(api: RunningApi, mode: instructor.Mode) -> instructor.Instructor:
    raw = openai.OpenAI(base_url=api.http_url + "/v1", api_key="unused", max_retries=0)
    return instructor.from_openai(raw, mode=mode)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA], ids=["tools", "json_schema"])
def test_instructor_returns_a_valid_model_every_time(api: RunningApi, mode: instructor.Mode) -> None:
    c = client(api, mode)
    for seed in range(3):
        city = c.chat.completions.create(model=MODEL, response_model=City, max_retries=0, max_tokens=120,
                                         temperature=0.9, seed=seed,
                                         messages=[{"role": "user", "content": "Describe Paris."}])
        assert isinstance(city, City)
        City.model_validate(city.model_dump())


def test_instructor_streams_partial_objects_in_tools_mode(api: RunningApi) -> None:
    c = client(api, instructor.Mode.TOOLS)
    partials = list(c.chat.completions.create_partial(model=MODEL, response_model=City, max_retries=0,
                                                      max_tokens=120, temperature=0.9, seed=4,
                                                      messages=[{"role": "user", "content": "Describe Oslo."}]))
    assert partials, "no partial object"
    final = City.model_validate(partials[-1].model_dump())
    assert final.climate in ("cold", "mild", "hot")


class Trip(pydantic.BaseModel):
    """A nested model: its JSON schema has `$defs` and references (City inside)."""

    start: City
    end: City
    days: int = pydantic.Field(ge=1, le=9)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA], ids=["tools", "json_schema"])
def test_instructor_nested_models_with_references(api: RunningApi, mode: instructor.Mode) -> None:
    trip = client(api, mode).chat.completions.create(
        model=MODEL, response_model=Trip, max_retries=0, max_tokens=200, temperature=0.9, seed=8,
        messages=[{"role": "user", "content": "Plan a trip from Paris to Rome."}])
    assert isinstance(trip, Trip) and isinstance(trip.start, City)
