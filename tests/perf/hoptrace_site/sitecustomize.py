"""Loaded by the services that tests/perf/hoptrace.py starts (PYTHONPATH): time
stamps of each socket receive and send, and of a request entering the request
guard, appended to $HOPTRACE_DIR/<service>-<pid>.log. Nothing in the services
is changed; only these functions are wrapped, in that process."""
import os
import time

if os.environ.get("HOPTRACE_DIR"):
    _files: dict = {}

    def _stamp(tag: str) -> None:
        pid = os.getpid()
        fd = _files.get(pid)
        if fd is None:
            path = os.path.join(os.environ["HOPTRACE_DIR"],
                                f"{os.environ['HOPTRACE_NAME']}-{pid}.log")
            fd = _files[pid] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, b"%.6f %s\n" % (time.time(), tag.encode()))

    import gevent._socket3 as _s3

    _recv, _sendall = _s3.socket.recv, _s3.socket.sendall

    def recv(self, *args):
        data = _recv(self, *args)
        _stamp("recv")
        return data

    def sendall(self, data, flags=0):
        _stamp("send")
        return _sendall(self, data, flags)

    _s3.socket.recv, _s3.socket.sendall = recv, sendall

    import common.guard as _guard

    _call = _guard.RequestGuard.__call__

    def guarded(self, environ, start_response):
        _stamp("app")
        return _call(self, environ, start_response)

    _guard.RequestGuard.__call__ = guarded
