"""Random-weight models of each supported family, made once per test session."""

import pytest

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    made: dict[str, str] = {}

    def get(preset: str = "tiny-llama") -> str:
        from benchmarks.make_model import make_random_model  # torch loads only for tests that need it

        if preset not in made:
            made[preset] = str(make_random_model(preset, tmp_path_factory.mktemp(preset), seed=1))
        return made[preset]

    return get
