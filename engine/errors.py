"""The engine's two error families (docs/style.md, item 9): request errors and overload are recoverable,
a dead engine is not."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelValidationError(EngineError, ValueError):
    """A model directory is missing, incomplete, or unsafe to load (names the file)."""


class RequestRejectedError(EngineError, ValueError):
    """A request that can never be served as asked (too long, more blocks than the pool has)."""


class EngineOverloadedError(EngineError):
    """The bounded waiting queue is full; the caller may retry later."""


class EngineDeadError(EngineError):
    """The engine loop died; no request can be served until the engine is recreated."""


class EngineNotRunningError(EngineDeadError):
    """Refused at arrival, before any work: the engine is dead, stopped or being replaced."""


class EngineStoppedError(EngineDeadError):
    """The engine was stopped on purpose (an unload, an eviction, a shutdown): it is not coming back."""


class RankDiedError(EngineDeadError):
    """A tensor-parallel rank died, or a forward raised while the ranks ran it together (they are then
    out of step): the engine cannot go on and is rebuilt."""


class EngineStepError(EngineError):
    """The engine failed this request (the engine itself lives on); counts against the model's breaker."""


class RequestFailedError(EngineError):
    """A step raised and the engine isolated this request as its cause: it alone ends, every other
    request goes on. Never resubmitted to another model (it would only break that one too)."""
