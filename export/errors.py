"""The exporter's one error type: bad input for an export, reported as one line naming the file."""


class ExportError(RuntimeError):
    """Bad input for an export (missing run or round, corrupt file, bad class set); one line."""
