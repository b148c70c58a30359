"""Logging for every ibckpt process: the level the user asked for on our own loggers, and never below
WARNING on the HTTP libraries, whose DEBUG lines carry request headers and bodies (an S3 access key
id in a SigV4 Authorization header, a bearer token, a Secret's data)."""

from __future__ import annotations

import logging

CHATTY = ("botocore", "boto3", "s3transfer", "urllib3", "kubernetes", "aiohttp")


def configure(level: str, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    logging.basicConfig(level=level.upper(), format=fmt)
    logging.getLogger().setLevel(level.upper())  # also when a handler was there before us
    for name in CHATTY:
        logger = logging.getLogger(name)
        logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
