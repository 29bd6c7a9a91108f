"""One side of a weight group, run under a given Python (test_rendezvous.py's cross-release test):

    python cross_torch_worker.py trainer PORT_FILE     # rank 0: hosts the rendezvous, writes its port, broadcasts
    python cross_torch_worker.py member PORT_FILE      # rank 1: joins, receives, checks the bytes

Prints one line, ``<role> torch <version>: ok`` or ``... FAILED <error>`` (exit 3), within TIMEOUT_S (default 20).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from nemo_dapo.engines import shm as S  # noqa: E402
from nemo_dapo.engines import weight_group as WG  # noqa: E402

BUCKET = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.bfloat16))]


def main(role: str, port_file: str) -> int:
    timeout_s = float(os.environ.get("TIMEOUT_S", "20"))
    specs, size = S.weight_layout(BUCKET)
    try:
        if role == "trainer":
            group = WG.WeightGroup("127.0.0.1", 1, timeout_s=timeout_s)
            with open(port_file + ".tmp", "w") as f:
                f.write(group.address.rsplit(":", 1)[1])
            os.replace(port_file + ".tmp", port_file)
            group.connect()
            group.broadcast(BUCKET, specs, size)
        else:
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(port_file):
                if time.monotonic() > deadline:
                    raise TimeoutError("the trainer wrote no port")
                time.sleep(0.05)
            member = WG.GroupMember("127.0.0.1", int(open(port_file).read()), 1, 2, timeout_s)
            got = dict(member.receive(specs, size))
            if not all(torch.equal(got[n], t) for n, t in BUCKET):
                raise AssertionError("the received bytes differ")
    except Exception as e:  # noqa: BLE001 - reported as the line the test reads
        print(f"{role} torch {torch.__version__}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              flush=True)
        return 3
    print(f"{role} torch {torch.__version__}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
