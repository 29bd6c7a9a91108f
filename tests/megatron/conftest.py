"""Fixtures of the megatron tests."""
import pytest


@pytest.fixture
def gloo_world_of_one():
    """A one-process gloo group for megatron-core's checkpoint save and load in the test process itself."""
    import torch.distributed as dist

    from tests.support.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
