from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_NONE: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
    TIER_LENT: _ClassVar[Tier]
TIER_NONE: Tier
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
TIER_LENT: Tier

class LendRequest(_message.Message):
    __slots__ = ("namespace", "keys", "blocks", "cache", "device_pci_bus_id", "hold_ms", "nonce", "readers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: bytes
    blocks: bytes
    cache: bytes
    device_pci_bus_id: str
    hold_ms: int
    nonce: int
    readers: int
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., blocks: _Optional[bytes] = ..., cache: _Optional[bytes] = ..., device_pci_bus_id: _Optional[str] = ..., hold_ms: _Optional[int] = ..., nonce: _Optional[int] = ..., readers: _Optional[int] = ...) -> None: ...

class LendResponse(_message.Message):
    __slots__ = ("lend_id",)
    LEND_ID_FIELD_NUMBER: _ClassVar[int]
    lend_id: int
    def __init__(self, lend_id: _Optional[int] = ...) -> None: ...

class LendsRequest(_message.Message):
    __slots__ = ("namespace", "lend_ids", "withdraw", "revoke")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEND_IDS_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    lend_ids: _containers.RepeatedScalarFieldContainer[int]
    withdraw: bool
    revoke: bool
    def __init__(self, namespace: _Optional[bytes] = ..., lend_ids: _Optional[_Iterable[int]] = ..., withdraw: _Optional[bool] = ..., revoke: _Optional[bool] = ...) -> None: ...

class LendsResponse(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, done: _Optional[_Iterable[int]] = ...) -> None: ...

class LentRead(_message.Message):
    __slots__ = ("read_id", "cache", "device_pci_bus_id", "blocks", "ttl_ms", "slot", "read_slots_sent", "nonce")
    READ_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    READ_SLOTS_SENT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    read_id: int
    cache: bytes
    device_pci_bus_id: str
    blocks: bytes
    ttl_ms: int
    slot: int
    read_slots_sent: bool
    nonce: int
    def __init__(self, read_id: _Optional[int] = ..., cache: _Optional[bytes] = ..., device_pci_bus_id: _Optional[str] = ..., blocks: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., slot: _Optional[int] = ..., read_slots_sent: _Optional[bool] = ..., nonce: _Optional[int] = ...) -> None: ...

class ReturnedRequest(_message.Message):
    __slots__ = ("namespace", "read_id", "unused")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    READ_ID_FIELD_NUMBER: _ClassVar[int]
    UNUSED_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    read_id: int
    unused: bool
    def __init__(self, namespace: _Optional[bytes] = ..., read_id: _Optional[int] = ..., unused: _Optional[bool] = ...) -> None: ...

class ArenaSlabsRequest(_message.Message):
    __slots__ = ("epoch", "first", "count")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    first: int
    count: int
    def __init__(self, epoch: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ArenaSlabsResponse(_message.Message):
    __slots__ = ("first", "count", "pinned", "num_slabs")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_SLABS_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    pinned: int
    num_slabs: int
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ..., pinned: _Optional[int] = ..., num_slabs: _Optional[int] = ...) -> None: ...

class PageSpec(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "latent", "kv_sharing", "tp_rank", "tp_size", "salt", "first_layer", "stop_layer", "weights", "hidden_layer", "layer_ids", "scales", "state")
    class KvSharingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENT_FIELD_NUMBER: _ClassVar[int]
    KV_SHARING_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    STOP_LAYER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    latent: bool
    kv_sharing: _containers.ScalarMap[int, int]
    tp_rank: int
    tp_size: int
    salt: str
    first_layer: int
    stop_layer: int
    weights: _containers.RepeatedCompositeFieldContainer[LayerWeights]
    hidden_layer: int
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    scales: str
    state: str
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., latent: _Optional[bool] = ..., kv_sharing: _Optional[_Mapping[int, int]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., salt: _Optional[str] = ..., first_layer: _Optional[int] = ..., stop_layer: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[LayerWeights, _Mapping]]] = ..., hidden_layer: _Optional[int] = ..., layer_ids: _Optional[_Iterable[int]] = ..., scales: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class LayerWeights(_message.Message):
    __slots__ = ("stop", "id")
    STOP_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    stop: int
    id: str
    def __init__(self, stop: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("spec", "client_name", "device_pci_bus_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    spec: PageSpec
    client_name: str
    device_pci_bus_id: str
    def __init__(self, spec: _Optional[_Union[PageSpec, _Mapping]] = ..., client_name: _Optional[str] = ..., device_pci_bus_id: _Optional[str] = ...) -> None: ...

class Arena(_message.Message):
    __slots__ = ("shm_path", "size", "device", "inode", "boot_id", "slab_bytes")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    size: int
    device: int
    inode: int
    boot_id: str
    slab_bytes: int
    def __init__(self, shm_path: _Optional[str] = ..., size: _Optional[int] = ..., device: _Optional[int] = ..., inode: _Optional[int] = ..., boot_id: _Optional[str] = ..., slab_bytes: _Optional[int] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("namespace", "chunk_tokens", "page_bytes", "arena", "lease_ttl_ms", "max_message_bytes", "local_socket", "gpu_pools", "epoch", "tenant", "credential", "commits_in_parts")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    GPU_POOLS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    COMMITS_IN_PARTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chunk_tokens: int
    page_bytes: int
    arena: Arena
    lease_ttl_ms: int
    max_message_bytes: int
    local_socket: str
    gpu_pools: _containers.RepeatedCompositeFieldContainer[GpuPool]
    epoch: int
    tenant: str
    credential: str
    commits_in_parts: bool
    def __init__(self, namespace: _Optional[bytes] = ..., chunk_tokens: _Optional[int] = ..., page_bytes: _Optional[int] = ..., arena: _Optional[_Union[Arena, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., local_socket: _Optional[str] = ..., gpu_pools: _Optional[_Iterable[_Union[GpuPool, _Mapping]]] = ..., epoch: _Optional[int] = ..., tenant: _Optional[str] = ..., credential: _Optional[str] = ..., commits_in_parts: _Optional[bool] = ...) -> None: ...

class GpuPool(_message.Message):
    __slots__ = ("device", "pci_bus_id", "ipc_handle", "size")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    device: int
    pci_bus_id: str
    ipc_handle: bytes
    size: int
    def __init__(self, device: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease", "lease_ttl_ms", "gpu_pools", "acquire", "epoch", "each", "lent_devices", "read_slots")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_POOLS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    LENT_DEVICES_FIELD_NUMBER: _ClassVar[int]
    READ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: bytes
    lease: bool
    lease_ttl_ms: int
    gpu_pools: _containers.RepeatedScalarFieldContainer[int]
    acquire: bool
    epoch: int
    each: bool
    lent_devices: _containers.RepeatedScalarFieldContainer[str]
    read_slots: bool
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., lease: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ..., gpu_pools: _Optional[_Iterable[int]] = ..., acquire: _Optional[bool] = ..., epoch: _Optional[int] = ..., each: _Optional[bool] = ..., lent_devices: _Optional[_Iterable[str]] = ..., read_slots: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_chunks", "tiers", "lease_id", "acquired", "lent")
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    hit_chunks: int
    tiers: bytes
    lease_id: int
    acquired: AcquireResponse
    lent: LentRead
    def __init__(self, hit_chunks: _Optional[int] = ..., tiers: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., acquired: _Optional[_Union[AcquireResponse, _Mapping]] = ..., lent: _Optional[_Union[LentRead, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ttl_ms", "epoch", "writer_pid", "writer_start_time", "gpu_bus_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WRITER_PID_FIELD_NUMBER: _ClassVar[int]
    WRITER_START_TIME_FIELD_NUMBER: _ClassVar[int]
    GPU_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: bytes
    lease_ttl_ms: int
    epoch: int
    writer_pid: int
    writer_start_time: int
    gpu_bus_id: str
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., writer_pid: _Optional[int] = ..., writer_start_time: _Optional[int] = ..., gpu_bus_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "in_gpu_pool", "gpu_pool")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    IN_GPU_POOL_FIELD_NUMBER: _ClassVar[int]
    GPU_POOL_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    in_gpu_pool: bool
    gpu_pool: int
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., in_gpu_pool: _Optional[bool] = ..., gpu_pool: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("namespace", "lease_id", "epoch", "commit_count")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    lease_id: int
    epoch: int
    commit_count: int
    def __init__(self, namespace: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., epoch: _Optional[int] = ..., commit_count: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("namespace", "lease_ids", "epoch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    def __init__(self, namespace: _Optional[bytes] = ..., lease_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("renewed",)
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    renewed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, renewed: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("ready_chunks", "offsets", "page_bytes", "tiers", "pools")
    READY_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ready_chunks: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    tiers: bytes
    pools: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ready_chunks: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., tiers: _Optional[bytes] = ..., pools: _Optional[_Iterable[int]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "lease_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    lease_id: int
    def __init__(self, namespace: _Optional[bytes] = ..., lease_id: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "bytes_used", "bytes_capacity", "pages", "extra", "nodes")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes_used: int
    bytes_capacity: int
    pages: int
    extra: _containers.ScalarMap[str, float]
    nodes: _containers.RepeatedCompositeFieldContainer[RemoteNode]
    def __init__(self, name: _Optional[str] = ..., bytes_used: _Optional[int] = ..., bytes_capacity: _Optional[int] = ..., pages: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ..., nodes: _Optional[_Iterable[_Union[RemoteNode, _Mapping]]] = ...) -> None: ...

class RemoteNode(_message.Message):
    __slots__ = ("address", "role", "up", "bytes_used", "bytes_capacity", "keys", "errors")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    up: bool
    bytes_used: int
    bytes_capacity: int
    keys: int
    errors: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., up: _Optional[bool] = ..., bytes_used: _Optional[int] = ..., bytes_capacity: _Optional[int] = ..., keys: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "model", "pages", "stored_bytes", "page_bytes", "tenant", "contents")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    model: str
    pages: int
    stored_bytes: int
    page_bytes: int
    tenant: str
    contents: str
    def __init__(self, namespace: _Optional[bytes] = ..., model: _Optional[str] = ..., pages: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., tenant: _Optional[str] = ..., contents: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "counters", "version", "uptime_s", "event_epoch")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    EVENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    counters: _containers.ScalarMap[str, float]
    version: str
    uptime_s: float
    event_epoch: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., event_epoch: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "keys", "tokens", "ttl_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned_chunks", "pinned_pages", "pinned_bytes")
    PINNED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    pinned_chunks: int
    pinned_pages: int
    pinned_bytes: int
    def __init__(self, pinned_chunks: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("since", "namespace", "from_now", "epoch")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FROM_NOW_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    since: int
    namespace: bytes
    from_now: bool
    epoch: int
    def __init__(self, since: _Optional[int] = ..., namespace: _Optional[bytes] = ..., from_now: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "kind", "tier", "namespace", "model", "tenant", "key", "parent", "reason", "epoch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_NONE: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
        RESYNC: _ClassVar[KVEvent.Kind]
    KIND_NONE: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    RESYNC: KVEvent.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: KVEvent.Kind
    tier: Tier
    namespace: bytes
    model: str
    tenant: str
    key: bytes
    parent: bytes
    reason: str
    epoch: int
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[KVEvent.Kind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., namespace: _Optional[bytes] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
