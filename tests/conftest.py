from tests.s3_server import s3_server  # noqa
