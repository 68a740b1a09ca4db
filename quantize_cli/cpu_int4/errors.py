"""The one exception the quantizer raises for bad input: the CLI prints its message on one line."""


class QuantizeError(Exception):
    """A problem with the user's input or environment, phrased so the user can fix it."""
