"""The one exception type for mistakes a user can fix."""


class XprepError(Exception):
    """A user-fixable problem: the CLI prints the message as one line and exits with status 2.

    Messages name the file (and line or record), what is wrong, and what to do about it.
    """

    exit_code = 2  # the CLI's exit status (a subclass may name another: train.trainer.TooManyBadSteps)
