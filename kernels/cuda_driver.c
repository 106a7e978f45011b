/*
 * Driver entry points through the runtime (see cuda_driver.h). The function
 * pointers are looked up once, thread-safely, on first use.
 */
#include "kernels/cuda_driver.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*pointer_get_attributes_fn)(unsigned int, CUpointer_attribute *, void **,
						CUdeviceptr);
typedef CUresult (*mem_get_address_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*stream_batch_mem_op_fn)(CUstream, unsigned int, CUstreamBatchMemOpParams *,
					   unsigned int);
typedef CUresult (*device_get_attribute_fn)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*get_error_name_fn)(CUresult, const char **);
typedef CUresult (*mem_retain_fn)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*mem_export_fn)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
				  unsigned long long);
typedef CUresult (*mem_import_fn)(CUmemGenericAllocationHandle *, void *,
				  CUmemAllocationHandleType);
typedef CUresult (*mem_release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*mem_granularity_fn)(size_t *, const CUmemAllocationProp *,
				       CUmemAllocationGranularity_flags);
typedef CUresult (*mem_properties_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*mem_reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
				   unsigned long long);
typedef CUresult (*mem_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*mem_map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
			       unsigned long long);
typedef CUresult (*mem_unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*mem_set_access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);

static pthread_once_t lookup_once = PTHREAD_ONCE_INIT;
static pointer_get_attributes_fn pointer_get_attributes;
static mem_get_address_range_fn mem_get_address_range;
static stream_batch_mem_op_fn stream_batch_mem_op;
static device_get_attribute_fn device_get_attribute;
/* The VMM calls (nk_cuda_vmm_*); any of them may be missing from an old driver. */
static get_error_name_fn get_error_name;
static mem_retain_fn mem_retain;
static mem_export_fn mem_export;
static mem_import_fn mem_import;
static mem_release_fn mem_release;
static mem_granularity_fn mem_granularity;
static mem_properties_fn mem_properties;
static mem_reserve_fn mem_reserve;
static mem_free_fn mem_free;
static mem_map_fn mem_map;
static mem_unmap_fn mem_unmap;
static mem_set_access_fn mem_set_access;

static void *lookup(const char *symbol)
{
	void *fn = NULL;
	enum cudaDriverEntryPointQueryResult status;
	if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &status) !=
		    cudaSuccess ||
	    status != cudaDriverEntryPointSuccess)
		return NULL;
	return fn;
}

static void lookup_all(void)
{
	pointer_get_attributes = (pointer_get_attributes_fn)lookup("cuPointerGetAttributes");
	mem_get_address_range = (mem_get_address_range_fn)lookup("cuMemGetAddressRange");
	stream_batch_mem_op = (stream_batch_mem_op_fn)lookup("cuStreamBatchMemOp");
	device_get_attribute = (device_get_attribute_fn)lookup("cuDeviceGetAttribute");
	get_error_name = (get_error_name_fn)lookup("cuGetErrorName");
	mem_retain = (mem_retain_fn)lookup("cuMemRetainAllocationHandle");
	mem_export = (mem_export_fn)lookup("cuMemExportToShareableHandle");
	mem_import = (mem_import_fn)lookup("cuMemImportFromShareableHandle");
	mem_release = (mem_release_fn)lookup("cuMemRelease");
	mem_granularity = (mem_granularity_fn)lookup("cuMemGetAllocationGranularity");
	mem_properties = (mem_properties_fn)lookup("cuMemGetAllocationPropertiesFromHandle");
	mem_reserve = (mem_reserve_fn)lookup("cuMemAddressReserve");
	mem_free = (mem_free_fn)lookup("cuMemAddressFree");
	mem_map = (mem_map_fn)lookup("cuMemMap");
	mem_unmap = (mem_unmap_fn)lookup("cuMemUnmap");
	mem_set_access = (mem_set_access_fn)lookup("cuMemSetAccess");
}

int nk_cuda_pointer_info(const void *ptr, struct nk_cuda_pointer_info *out, const char **why)
{
	pthread_once(&lookup_once, lookup_all);
	if (!pointer_get_attributes) {
		*why = "the CUDA driver is not available";
		return -1;
	}
	CUdeviceptr start = 0;
	size_t size = 0;
	unsigned long long buffer_id = 0;
	int device = -1, ipc = 0;
	unsigned int managed = 0;
	CUmemoryPool pool = NULL;
	CUmemorytype type = (CUmemorytype)0;
	/* Wider than the driver writes (zeroed, little-endian): any width reads right. */
	uint64_t handle_types = 0;
	CUpointer_attribute attrs[] = {
		CU_POINTER_ATTRIBUTE_MEMORY_TYPE,     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
		CU_POINTER_ATTRIBUTE_RANGE_SIZE,      CU_POINTER_ATTRIBUTE_BUFFER_ID,
		CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,  CU_POINTER_ATTRIBUTE_IS_MANAGED,
		CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
		CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
	};
	void *data[] = {&type, &start, &size, &buffer_id, &device, &managed, &ipc, &pool,
			&handle_types};
	if (pointer_get_attributes(sizeof(attrs) / sizeof(attrs[0]), attrs, data,
				   (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS) {
		*why = "cuPointerGetAttributes failed";
		return -1;
	}
	if (type != CU_MEMORYTYPE_DEVICE || start == 0) {
		*why = "not a CUDA device pointer";
		return -1;
	}
	out->base = (uint64_t)start;
	out->size = (uint64_t)size;
	out->buffer_id = buffer_id;
	out->device = device;
	out->managed = managed != 0;
	out->from_pool = pool != NULL;
	out->ipc_capable = ipc != 0;
	out->vmm_fd_capable = !out->ipc_capable && !out->managed && !out->from_pool &&
			      (handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
	return 0;
}

int nk_cuda_pointer_buffer_id(const void *ptr, unsigned long long *buffer_id)
{
	pthread_once(&lookup_once, lookup_all);
	if (!pointer_get_attributes)
		return -1;
	CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_BUFFER_ID;
	unsigned long long id = 0;
	void *data[] = {&id};
	/* A pointer CUDA does not know succeeds too, with the default id 0. */
	if (pointer_get_attributes(1, &attr, data, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS ||
	    id == 0)
		return -1;
	*buffer_id = id;
	return 0;
}

int nk_cuda_allocation_size(const void *base, uint64_t *size, const char **why)
{
	pthread_once(&lookup_once, lookup_all);
	if (!mem_get_address_range) {
		*why = "the CUDA driver is not available";
		return -1;
	}
	CUdeviceptr start = 0;
	size_t bytes = 0;
	if (mem_get_address_range(&start, &bytes, (CUdeviceptr)(uintptr_t)base) != CUDA_SUCCESS) {
		*why = "cuMemGetAddressRange failed";
		return -1;
	}
	*size = (uint64_t)(bytes - ((uintptr_t)base - (uintptr_t)start));
	return 0;
}

/* ---- VMM memory ------------------------------------------------------------------ */

static const char *result_name(CUresult rc)
{
	const char *name = NULL;
	if (!get_error_name || get_error_name(rc, &name) != CUDA_SUCCESS || !name)
		return "unknown CUDA error";
	return name;
}

/*
 * The mapping at `addr`: where it starts, its size and physical allocation;
 * 0 or -1. `first`: addr is the range's start, known to be device memory.
 */
static int vmm_chunk_at(uint64_t addr, int device, bool first, struct nk_cuda_vmm_chunk *out,
			const char **why)
{
	/* Wider than the driver writes (zeroed, little-endian): any width reads right. */
	uint64_t mapped = 0, base = 0, size = 0, block = 0, handle_types = 0;
	int ordinal = -1;
	CUpointer_attribute attrs[] = {
		CU_POINTER_ATTRIBUTE_MAPPED,          CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
		CU_POINTER_ATTRIBUTE_MAPPING_SIZE,    CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
		CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,  CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
	};
	void *data[] = {&mapped, &base, &size, &block, &ordinal, &handle_types};
	if (pointer_get_attributes(sizeof(attrs) / sizeof(attrs[0]), attrs, data,
				   (CUdeviceptr)addr) != CUDA_SUCCESS) {
		*why = first ? "cuPointerGetAttributes cannot describe VMM mappings (the mapping and "
			       "memory block attributes need a driver of CUDA 12 or later)"
			     : "the range runs into device addresses that are not mapped "
			       "(cuPointerGetAttributes failed there)";
		return -1;
	}
	if (!mapped || size == 0 || addr < base || addr - base >= size) {
		*why = "the range runs into device addresses that are not mapped";
		return -1;
	}
	if (block == 0) {
		*why = "the driver gives no memory block id for VMM memory, so a remapped chunk "
		       "could not be told from the one registered";
		return -1;
	}
	if (ordinal != device) {
		*why = "the range spans mappings of different devices";
		return -1;
	}
	if (!(handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
		*why = "a VMM chunk of the range was not created with the POSIX file descriptor "
		       "handle type (cuMemCreate's requestedHandleTypes), so it cannot be exported";
		return -1;
	}
	out->base = base;
	out->size = size;
	out->block_id = block;
	return 0;
}

int nk_cuda_vmm_chunks(const void *ptr, uint64_t bytes, int device, struct nk_cuda_vmm_chunk *out,
		       unsigned max, const char **why)
{
	pthread_once(&lookup_once, lookup_all);
	if (!pointer_get_attributes) {
		*why = "the CUDA driver is not available";
		return -1;
	}
	uint64_t addr = (uint64_t)(uintptr_t)ptr, end;
	if (__builtin_add_overflow(addr, bytes ? bytes : 1, &end)) {
		*why = "the range wraps around the address space";
		return -1;
	}
	unsigned n = 0;
	while (addr < end) {
		if (n == max)
			return (int)max + 1;
		if (vmm_chunk_at(addr, device, n == 0, &out[n], why) != 0)
			return -1;
		addr = out[n].base + out[n].size;
		n++;
	}
	return (int)n;
}

int nk_cuda_vmm_export(uint64_t base, int *fd, const char **why)
{
	pthread_once(&lookup_once, lookup_all);
	if (!mem_retain || !mem_export || !mem_release) {
		*why = "the CUDA driver lacks the VMM export calls";
		return -1;
	}
	CUmemGenericAllocationHandle handle;
	if (mem_retain(&handle, (void *)(uintptr_t)base) != CUDA_SUCCESS) {
		*why = "cuMemRetainAllocationHandle failed (the chunk is no longer mapped?)";
		return -1;
	}
	int out = -1;
	CUresult rc = mem_export(&out, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	mem_release(handle); /* the retain's reference; the mapping keeps the allocation */
	if (rc != CUDA_SUCCESS || out < 0) {
		*why = "cuMemExportToShareableHandle (POSIX fd) failed";
		return -1;
	}
	*fd = out;
	return 0;
}

/* Maps chunks [0, count) back to back from base, then grants `device` read and write. */
static int vmm_map_all(int device, CUdeviceptr base, uint64_t total, const uint64_t *sizes,
		       const uint64_t *handles, unsigned count, unsigned *mapped,
		       char *why, size_t why_len)
{
	uint64_t offset = 0;
	for (*mapped = 0; *mapped < count; (*mapped)++) {
		unsigned i = *mapped;
		CUresult rc = mem_map(base + offset, (size_t)sizes[i], 0,
				      (CUmemGenericAllocationHandle)handles[i], 0);
		if (rc != CUDA_SUCCESS) {
			snprintf(why, why_len, "chunk %u: cannot map %llu bytes of it (%s): %s", i,
				 (unsigned long long)sizes[i], result_name(rc),
				 rc == CUDA_ERROR_INVALID_VALUE ? "larger than its allocation"
								: "no memory for the mapping");
			return rc == CUDA_ERROR_INVALID_VALUE ? NK_VMM_TOO_LARGE : NK_VMM_NO_MEMORY;
		}
		offset += sizes[i];
	}
	CUmemAccessDesc access;
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CUresult rc = mem_set_access(base, (size_t)total, &access, 1);
	if (rc != CUDA_SUCCESS) {
		snprintf(why, why_len, "cuMemSetAccess on device %d failed (%s)", device,
			 result_name(rc));
		return NK_VMM_NO_MEMORY;
	}
	return 0;
}

/* Imports each fd; checks the chunk's device. Returns 0 or an nk_vmm_error (*imported made). */
static int vmm_import_all(int device, const int *fds, unsigned count, uint64_t *handles,
			  unsigned *imported, char *why, size_t why_len)
{
	for (*imported = 0; *imported < count; (*imported)++) {
		unsigned i = *imported;
		CUmemGenericAllocationHandle h;
		CUresult rc = mem_import(&h, (void *)(uintptr_t)fds[i],
					 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (rc != CUDA_SUCCESS) {
			snprintf(why, why_len, "chunk %u: the fd is not a CUDA VMM allocation this "
				 "daemon can import (cuMemImportFromShareableHandle: %s)",
				 i, result_name(rc));
			return NK_VMM_BAD_CHUNK;
		}
		handles[i] = (uint64_t)h;
		CUmemAllocationProp prop;
		memset(&prop, 0, sizeof(prop));
		if (mem_properties(&prop, h) != CUDA_SUCCESS ||
		    prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device) {
			(*imported)++; /* released by the caller */
			snprintf(why, why_len, "chunk %u is not memory of device %d", i, device);
			return NK_VMM_BAD_CHUNK;
		}
	}
	return 0;
}

/* The device's allocation granularity, and the sum of sizes, each checked against it. */
static int vmm_check_sizes(int device, const uint64_t *sizes, unsigned count, uint64_t *total,
			   size_t *granularity_out, char *why, size_t why_len)
{
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = device;
	size_t granularity = 0;
	CUresult rc = mem_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (rc != CUDA_SUCCESS || granularity == 0) {
		snprintf(why, why_len, "cannot read device %d's allocation granularity (%s)", device,
			 result_name(rc));
		return NK_VMM_NO_DRIVER;
	}
	*total = 0;
	for (unsigned i = 0; i < count; i++) {
		if (sizes[i] == 0 || sizes[i] % granularity ||
		    __builtin_add_overflow(*total, sizes[i], total)) {
			snprintf(why, why_len, "chunk %u: size %llu is not a positive multiple of "
				 "device %d's allocation granularity (%zu bytes)",
				 i, (unsigned long long)sizes[i], device, granularity);
			return NK_VMM_BAD_CHUNK;
		}
	}
	*granularity_out = granularity;
	return 0;
}

int nk_cuda_vmm_import(int device, const int *fds, const uint64_t *sizes, unsigned count,
		       uint64_t *base, uint64_t *handles, char *why, size_t why_len)
{
	pthread_once(&lookup_once, lookup_all);
	if (!mem_import || !mem_release || !mem_granularity || !mem_properties || !mem_reserve ||
	    !mem_free || !mem_map || !mem_unmap || !mem_set_access) {
		snprintf(why, why_len, "the CUDA driver lacks the VMM calls");
		return NK_VMM_NO_DRIVER;
	}
	uint64_t total = 0;
	size_t granularity = 0;
	int rc = vmm_check_sizes(device, sizes, count, &total, &granularity, why, why_len);
	if (rc)
		return rc;
	unsigned imported = 0, mapped = 0;
	CUdeviceptr va = 0;
	rc = vmm_import_all(device, fds, count, handles, &imported, why, why_len);
	if (rc)
		goto out_release;
	/* cuMemMap wants every chunk's address aligned to the granularity. */
	CUresult res = mem_reserve(&va, (size_t)total, granularity, 0, 0);
	if (res != CUDA_SUCCESS) {
		snprintf(why, why_len, "cannot reserve %llu bytes of device address space (%s)",
			 (unsigned long long)total, result_name(res));
		rc = NK_VMM_NO_MEMORY;
		va = 0;
		goto out_release;
	}
	rc = vmm_map_all(device, va, total, sizes, handles, count, &mapped, why, why_len);
	if (rc)
		goto out_unmap;
	*base = (uint64_t)va;
	return 0;
out_unmap:
	for (uint64_t offset = 0, i = 0; i < mapped; offset += sizes[i], i++)
		mem_unmap(va + offset, (size_t)sizes[i]);
	mem_free(va, (size_t)total);
out_release:
	for (unsigned i = 0; i < imported; i++)
		mem_release((CUmemGenericAllocationHandle)handles[i]);
	return rc;
}

int nk_cuda_vmm_unmap(uint64_t base, const uint64_t *sizes, const uint64_t *handles,
		      unsigned count)
{
	pthread_once(&lookup_once, lookup_all);
	if (!mem_unmap || !mem_free || !mem_release)
		return -1;
	int rc = 0;
	uint64_t offset = 0;
	for (unsigned i = 0; i < count; i++) {
		rc |= mem_unmap((CUdeviceptr)(base + offset), (size_t)sizes[i]) != CUDA_SUCCESS;
		offset += sizes[i];
	}
	rc |= mem_free((CUdeviceptr)base, (size_t)offset) != CUDA_SUCCESS;
	for (unsigned i = 0; i < count; i++)
		rc |= mem_release((CUmemGenericAllocationHandle)handles[i]) != CUDA_SUCCESS;
	return rc ? -1 : 0;
}

static void op_write(CUstreamBatchMemOpParams *op, void *word, uint32_t value)
{
	memset(op, 0, sizeof(*op));
	op->writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
	op->writeValue.address = (CUdeviceptr)(uintptr_t)word;
	op->writeValue.value = value;
	op->writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT; /* fenced after earlier writes */
}

static void op_wait(CUstreamBatchMemOpParams *op, void *word, uint32_t value)
{
	memset(op, 0, sizeof(*op));
	op->waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
	op->waitValue.address = (CUdeviceptr)(uintptr_t)word;
	op->waitValue.value = value;
	op->waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
}

static int batch(void *stream, unsigned count, CUstreamBatchMemOpParams *ops)
{
	pthread_once(&lookup_once, lookup_all);
	if (!stream_batch_mem_op)
		return -1;
	return stream_batch_mem_op((CUstream)stream, count, ops, 0) == CUDA_SUCCESS ? 0 : -1;
}

int nk_cuda_stream_signal_wait(void *stream, void *word, uint32_t value, void *wait_word,
			       uint32_t wait_value)
{
	CUstreamBatchMemOpParams ops[2];
	op_write(&ops[0], word, value);
	op_wait(&ops[1], wait_word, wait_value);
	return batch(stream, 2, ops);
}

int nk_cuda_stream_wait(void *stream, void *word, uint32_t value)
{
	CUstreamBatchMemOpParams op;
	op_wait(&op, word, value);
	return batch(stream, 1, &op);
}

int nk_cuda_stream_write(void *stream, void *word_a, void *word_b, uint32_t value)
{
	CUstreamBatchMemOpParams ops[2];
	op_write(&ops[0], word_a, value);
	if (word_b)
		op_write(&ops[1], word_b, value);
	return batch(stream, word_b ? 2 : 1, ops);
}

int nk_cuda_mps_enabled(int device)
{
	pthread_once(&lookup_once, lookup_all);
	int value = 0;
	if (!device_get_attribute ||
	    device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, (CUdevice)device) !=
		    CUDA_SUCCESS)
		return -1;
	return value != 0;
}

int nk_ipc_event_cache_init(struct nk_ipc_event_cache *cache, unsigned capacity)
{
	memset(cache, 0, sizeof(*cache));
	cache->entries = calloc(capacity, sizeof(*cache->entries));
	if (!cache->entries)
		return -1;
	cache->capacity = capacity;
	pthread_mutex_init(&cache->lock, NULL);
	return 0;
}

void nk_ipc_event_cache_destroy(struct nk_ipc_event_cache *cache)
{
	if (!cache->entries)
		return;
	for (unsigned i = 0; i < cache->count; i++)
		cudaEventDestroy((cudaEvent_t)cache->entries[i].event);
	pthread_mutex_destroy(&cache->lock);
	free(cache->entries);
	cache->entries = NULL;
}

/* A slot for a new entry: a free one, else the next unheld one; -1 if all are held. */
static int event_cache_slot(struct nk_ipc_event_cache *cache)
{
	if (cache->count < cache->capacity)
		return (int)cache->count++;
	for (unsigned tries = 0; tries < cache->capacity; tries++) {
		unsigned slot = cache->next++ % cache->capacity;
		if (cache->entries[slot].users == 0) {
			cudaEventDestroy((cudaEvent_t)cache->entries[slot].event);
			return (int)slot;
		}
	}
	return -1;
}

void *nk_ipc_event_open(struct nk_ipc_event_cache *cache, const uint8_t handle[64])
{
	cudaEvent_t event = NULL;
	pthread_mutex_lock(&cache->lock);
	for (unsigned i = 0; i < cache->count; i++) {
		if (!memcmp(cache->entries[i].handle, handle, 64)) {
			cache->entries[i].users++;
			event = (cudaEvent_t)cache->entries[i].event;
			goto out;
		}
	}
	cudaIpcEventHandle_t h;
	memcpy(&h, handle, sizeof(h));
	if (cudaIpcOpenEventHandle(&event, h) != cudaSuccess) {
		cudaGetLastError(); /* not sticky: clear it */
		event = NULL;
		goto out;
	}
	int slot = event_cache_slot(cache);
	if (slot >= 0) {
		memcpy(cache->entries[slot].handle, handle, 64);
		cache->entries[slot].event = event;
		cache->entries[slot].users = 1;
	}
out:
	pthread_mutex_unlock(&cache->lock);
	return event;
}

void nk_ipc_event_release(struct nk_ipc_event_cache *cache, void *event)
{
	if (!event)
		return;
	pthread_mutex_lock(&cache->lock);
	bool cached = false;
	for (unsigned i = 0; i < cache->count && !cached; i++) {
		if (cache->entries[i].event == event) {
			cache->entries[i].users--;
			cached = true;
		}
	}
	pthread_mutex_unlock(&cache->lock);
	if (!cached)
		cudaEventDestroy((cudaEvent_t)event); /* opened while every entry was held */
}
