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
#include <stdlib.h>
#include <string.h>

typedef CUresult (*pointer_get_attributes_fn)(unsigned int, CUpointer_attribute *, void **,
						CUdeviceptr);
typedef CUresult (*mem_get_address_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*stream_batch_mem_op_fn)(CUstream, unsigned int, CUstreamBatchMemOpParams *,
					   unsigned int);
typedef CUresult (*device_get_attribute_fn)(int *, CUdevice_attribute, CUdevice);

static pthread_once_t lookup_once = PTHREAD_ONCE_INIT;
static pointer_get_attributes_fn pointer_get_attributes;
static mem_get_address_range_fn mem_get_address_range;
static stream_batch_mem_op_fn stream_batch_mem_op;
static device_get_attribute_fn device_get_attribute;

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
	CUpointer_attribute attrs[] = {
		CU_POINTER_ATTRIBUTE_MEMORY_TYPE,     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
		CU_POINTER_ATTRIBUTE_RANGE_SIZE,      CU_POINTER_ATTRIBUTE_BUFFER_ID,
		CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,  CU_POINTER_ATTRIBUTE_IS_MANAGED,
		CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
	};
	void *data[] = {&type, &start, &size, &buffer_id, &device, &managed, &ipc, &pool};
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
