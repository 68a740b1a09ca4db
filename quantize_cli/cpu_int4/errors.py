"""The exceptions for bad input: the CLI prints their message on one line and exits 1."""


class UserError(Exception):
    """A problem with the user's input or environment, phrased so the user can fix it."""


class QuantizeError(UserError):
    """`cpu-int4 quantize` or `push` cannot go on."""


class EvalError(UserError):
    """`cpu-int4 eval` cannot go on."""
