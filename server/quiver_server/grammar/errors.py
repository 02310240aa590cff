"""The one error type of the grammar package."""


class GrammarError(ValueError):
    """A grammar that cannot be used for a request. The message is for the client: it says what
    is wrong with the grammar and never names a server path. A ValueError, so the service answers
    INVALID_ARGUMENT when it reaches a step."""
