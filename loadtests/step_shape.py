"""Step load 16 -> 32 -> 64 -> 96 users, each step a quarter of --run-time (30 s each without it).
Selected by adding this file to the locustfile list:

    locust -f loadtests/locustfile.py,loadtests/step_shape.py --headless -H URL -t 120s
"""

from locust import LoadTestShape

STEPS = (16, 32, 64, 96)  # users per step
SPAWN_RATE = 16  # users started per second when stepping up
DEFAULT_STEP_SECONDS = 30


class StepLoadShape(LoadTestShape):
    use_common_options = True  # reads --run-time; --users and --spawn-rate are not used

    def tick(self) -> tuple[int, float] | None:
        run_time = getattr(self.runner.environment.parsed_options, "run_time", None)
        step_seconds = run_time / len(STEPS) if run_time else DEFAULT_STEP_SECONDS
        step = int(self.get_run_time() // step_seconds)
        if step >= len(STEPS):
            return None
        return STEPS[step], SPAWN_RATE
