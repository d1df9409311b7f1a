from billing_sync.upload import upload


class FakeClient:
    def put_object(self, **kw):
        return kw


def test_upload():
    assert upload(FakeClient(), "b", "k", b"x")["Key"] == "k"
