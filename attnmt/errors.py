"""Errors a user can fix. The command line prints them as one line, with no traceback."""


class UserError(Exception):
    """Bad input or a bad option: the message names what is wrong and how to fix it."""
