"""The serving core: requests, the KV-cache manager (blocks on demand, prefix caching) and the scheduler.

vLLM: ``vllm/v1/core/``. Host-side only (NumPy / Python); the device step lives in :mod:`jaxkv.engine`.
"""

from jaxkv.core.host_kv_pool import HostBlockPool
from jaxkv.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["HostBlockPool", "HybridKVCacheManager", "KVCacheManager", "Request", "RequestStatus", "Scheduler",
           "SchedulerConfig", "SchedulerOutput"]
