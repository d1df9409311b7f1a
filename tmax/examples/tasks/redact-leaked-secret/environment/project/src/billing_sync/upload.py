import os
import time


def credentials():
    return os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]


def upload(client, bucket, key, data, retries=5):
    for attempt in range(retries):
        try:
            return client.put_object(Bucket=bucket, Key=key, Body=data)
        except ConnectionError:
            time.sleep(2 ** attempt)
    raise RuntimeError("upload failed")
