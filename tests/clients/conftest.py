"""The third-party clients users reach us with (the `clients` extra): the in-process apps of
tests/service over real tiny engines, served to them by URL."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches its price list at import otherwise

from tests.service.conftest import sdk, start, tiny_models  # noqa: E402,F401  (the fixtures, shared)
