// normd's eager LayerNorm and RMSNorm as one PyTorch operator whose autograd
// is C++: the per-call work of normd.normalization's enqueue mode (checks,
// outputs, the autograd node, the library's enqueue) without the Python
// interpreter in between. normd/eager.py compiles it on first use against the
// installed torch (PyTorch's operator and autograd API is C++ only) and binds
// it to the libnormclient the package loaded; it falls back to the Python
// path wherever this file says so.
//
// Errors travel as RuntimeError messages that normd/eager.py parses:
//   "normd-eager fallback: why"   a case this file leaves to the Python path
//                                 (it raises the Python path's own errors);
//   "normd error CODE (NAME): message"   the library refused the job.
#include <atomic>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include "normclient.h"

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using enqueue_device_fn = int (*)(nc_conn *, const struct nc_job *,
				  const void *const[NC_JOB_TENSORS], void *);
using text_fn = const char *(*)(int);
using last_error_fn = const char *(*)(void);

// libnormclient's entry points, from the copy the Python package loaded.
std::atomic<enqueue_device_fn> enqueue_device{nullptr};
std::atomic<last_error_fn> last_error{nullptr};
std::atomic<text_fn> status_name{nullptr};
// Jobs this operator enqueued, for tests that check which path ran.
std::atomic<int64_t> jobs_enqueued{0};
// Host tensors pass for device ones (bench/bench_host_path.py's stub, no GPU).
std::atomic<bool> accept_host{false};

// Connections the Python package opened and has not closed, with the process
// that opened them: a closed or inherited handle must never reach the library.
std::mutex conns_lock;
std::unordered_map<int64_t, pid_t> conns;

[[noreturn]] void fallback(const char *why)
{
	TORCH_CHECK(false, "normd-eager fallback: ", why);
}

[[noreturn]] void library_error(int rc)
{
	const char *name = status_name.load()(rc);
	const char *message = last_error.load()();
	TORCH_CHECK(false, "normd error ", rc, " (", name ? name : "?", "): ",
		    message ? message : "");
}

nc_conn *live_conn(int64_t handle)
{
	std::lock_guard<std::mutex> hold(conns_lock);
	auto it = conns.find(handle);
	if (it == conns.end() || it->second != getpid())
		TORCH_CHECK(false, "normd error ", static_cast<int>(NC_EINVALID_ARGUMENT),
			    " (INVALID_ARGUMENT): the client is closed, or was opened by another "
			    "process (a forked child must open its own normd.Client)");
	return reinterpret_cast<nc_conn *>(handle);
}

int dtype_code(at::ScalarType t)
{
	switch (t) {
	case at::kFloat:
		return NC_F32;
	case at::kHalf:
		return NC_F16;
	case at::kBFloat16:
		return NC_BF16;
	default:
		return 0;
	}
}

const void *ptr_or_null(const Tensor &t)
{
	return t.defined() ? t.data_ptr() : nullptr;
}

void *current_stream(const Tensor &t)
{
	if (!t.is_cuda())
		return nullptr;
	const auto *impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
	return impl->getStream(t.device()).native_handle();
}

// One job through the library; `t` in struct nc_job's role order.
void enqueue(int64_t handle, const Tensor &on, int op, uint64_t rows, uint64_t cols, double eps,
	     int dtype, int weight_dtype, unsigned flags, const Tensor (&t)[10])
{
	nc_conn *conn = live_conn(handle);
	struct nc_job job = {};
	job.op = static_cast<enum nc_op>(op);
	job.rows = rows;
	job.cols = cols;
	job.eps = static_cast<float>(eps);
	job.dtype = static_cast<enum nc_dtype>(dtype);
	job.weight_dtype = static_cast<enum nc_dtype>(weight_dtype);
	job.flags = flags;
	const void *ptrs[NC_JOB_TENSORS] = {};
	for (int i = 0; i < 10; i++)
		ptrs[i] = ptr_or_null(t[i]);
	int rc = enqueue_device.load()(conn, &job, ptrs, current_stream(on));
	if (rc)
		library_error(rc);
	jobs_enqueued.fetch_add(1, std::memory_order_relaxed);
}

// The shapes and dtypes normd.normalization's Python path accepts without
// converting anything; every other case is left to it.
void check_param(const Tensor &p, const Tensor &input, c10::IntArrayRef shape)
{
	if (p.defined() && (p.sizes() != shape || p.device() != input.device()))
		fallback("a parameter's shape or device");
}

struct Plan {
	uint64_t rows, cols;
	int dtype, weight_dtype;
};

Plan plan(const Tensor &input, const Tensor &weight, const Tensor &bias, c10::IntArrayRef shape)
{
	Plan p{};
	p.dtype = dtype_code(input.scalar_type());
	if (!p.dtype || !(input.is_cuda() || accept_host.load()) || input.numel() == 0)
		fallback("not a CUDA tensor normd computes on");
	const size_t n = shape.size();
	const auto dims = input.sizes();
	if (n == 0 || dims.size() < n || dims.slice(dims.size() - n) != shape)
		fallback("normalized_shape does not fit the input");
	check_param(weight, input, shape);
	check_param(bias, input, shape);
	if (bias.defined() && (!weight.defined() || bias.scalar_type() != weight.scalar_type()))
		fallback("bias without weight, or of another dtype");
	if (weight.defined() && weight.scalar_type() != input.scalar_type()) {
		if (weight.scalar_type() != at::kFloat)
			fallback("weights of another dtype than the input's or float32");
		p.weight_dtype = NC_F32;
	}
	p.cols = 1;
	for (int64_t d : shape)
		p.cols *= static_cast<uint64_t>(d);
	p.rows = static_cast<uint64_t>(input.numel()) / p.cols;
	return p;
}

// The forward's ints a backward needs, in ctx->saved_data["job"].
enum { JOB_ROWS, JOB_COLS, JOB_RMS, JOB_MEMORY_EFFICIENT, JOB_WEIGHT_DTYPE, JOB_HANDLE };

class NormFunction : public torch::autograd::Function<NormFunction> {
      public:
	// Absent parameters are empty optionals: autograd takes no undefined inputs.
	static Tensor forward(AutogradContext *ctx, const Tensor &input,
			      const std::optional<Tensor> &weight_in,
			      const std::optional<Tensor> &bias_in, c10::IntArrayRef shape,
			      double eps, bool rms, bool memory_efficient, int64_t handle)
	{
		const Tensor weight = weight_in ? weight_in->contiguous() : Tensor();
		const Tensor bias = bias_in ? bias_in->contiguous() : Tensor();
		const Plan p = plan(input, weight, bias, shape);
		const Tensor x = input.contiguous();
		const auto stats = x.options().dtype(at::kFloat);
		const Tensor y = at::empty(x.sizes(), x.options());
		const int64_t rows = static_cast<int64_t>(p.rows);
		const Tensor mean = rms ? Tensor() : at::empty({rows}, stats);
		const Tensor invvar = at::empty({rows}, stats);
		const Tensor tensors[10] = {x, y, mean, invvar, weight, bias, {}, {}, {}, {}};
		enqueue(handle, x, rms ? NC_RMSNORM_FWD : NC_LAYERNORM_FWD, p.rows, p.cols, eps,
			p.dtype, p.weight_dtype, 0, tensors);
		// What apex saves: the input (the output with memory_efficient), the
		// parameters, LayerNorm's mean (not with memory_efficient), invvar.
		ctx->save_for_backward({memory_efficient ? y : x, weight, bias,
					memory_efficient ? Tensor() : mean, invvar});
		// Two entries rather than seven: each is a string-keyed insert.
		ctx->saved_data["job"] = std::vector<int64_t>{
			rows, static_cast<int64_t>(p.cols), rms, memory_efficient, p.weight_dtype,
			handle};
		ctx->saved_data["eps"] = eps;
		return y;
	}

	static variable_list backward(AutogradContext *ctx, variable_list grads)
	{
		variable_list out = gradients(ctx, grads[0]);
		// Differentiable once, as apex's are (Python's once_differentiable): with a
		// graph asked for, the gradients lead to a node that raises if reached.
		if (at::GradMode::is_enabled() && grads[0].requires_grad()) {
			auto error = std::make_shared<torch::autograd::DelayedError>(
				"trying to differentiate twice a function that was marked with "
				"@once_differentiable (normd's norms are differentiable once)", 3);
			variable_list leaves;
			for (int i = 0; i < 3; i++)
				leaves.push_back(out[i].defined() ? out[i].detach().requires_grad_(true)
								  : Tensor());
			variable_list wrapped = (*error)(std::move(leaves));
			for (int i = 0; i < 3; i++)
				out[i] = wrapped[i];
		}
		out.resize(8);
		return out;
	}

      private:
	// dx, dgamma, dbeta (those not asked for undefined), computed without a graph.
	static variable_list gradients(AutogradContext *ctx, const Tensor &grad)
	{
		at::NoGradGuard no_graph;
		const auto saved = ctx->get_saved_variables();
		const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
		const Tensor &mean = saved[3], &invvar = saved[4];
		const auto job = ctx->saved_data["job"].toIntVector();
		const bool rms = job[JOB_RMS] != 0, memory_efficient = job[JOB_MEMORY_EFFICIENT] != 0;
		Tensor dy = grad.contiguous();
		if (dy.scalar_type() != x.scalar_type())
			dy = dy.to(x.scalar_type());
		const Tensor dx = at::empty(x.sizes(), x.options());
		const Tensor dgamma = weight.defined() && ctx->needs_input_grad(1)
					      ? at::empty_like(weight) : Tensor();
		const Tensor dbeta = bias.defined() && ctx->needs_input_grad(2)
					     ? at::empty_like(bias) : Tensor();
		const Tensor tensors[10] = {x, {}, mean, invvar, weight, bias, dy, dx, dgamma, dbeta};
		enqueue(job[JOB_HANDLE], x, rms ? NC_RMSNORM_BWD : NC_LAYERNORM_BWD,
			static_cast<uint64_t>(job[JOB_ROWS]), static_cast<uint64_t>(job[JOB_COLS]),
			ctx->saved_data["eps"].toDouble(), dtype_code(x.scalar_type()),
			static_cast<int>(job[JOB_WEIGHT_DTYPE]),
			memory_efficient ? static_cast<unsigned>(NC_MEMORY_EFFICIENT) : 0u, tensors);
		return {dx, dgamma, dbeta};
	}
};

Tensor norm(const Tensor &input, const std::optional<Tensor> &weight,
	    const std::optional<Tensor> &bias, c10::IntArrayRef normalized_shape, double eps,
	    bool rms, bool memory_efficient, int64_t handle)
{
	return NormFunction::apply(input, weight, bias, normalized_shape, eps, rms, memory_efficient,
				   handle);
}

void bind(int64_t enqueue_device_addr, int64_t last_error_addr, int64_t status_name_addr,
	  bool host_tensors)
{
	accept_host.store(host_tensors);
	enqueue_device.store(reinterpret_cast<enqueue_device_fn>(enqueue_device_addr));
	last_error.store(reinterpret_cast<last_error_fn>(last_error_addr));
	status_name.store(reinterpret_cast<text_fn>(status_name_addr));
}

int64_t jobs()
{
	return jobs_enqueued.load(std::memory_order_relaxed);
}

void conn_opened(int64_t handle)
{
	std::lock_guard<std::mutex> hold(conns_lock);
	conns[handle] = getpid();
}

void conn_closed(int64_t handle)
{
	std::lock_guard<std::mutex> hold(conns_lock);
	conns.erase(handle);
}

} // namespace

TORCH_LIBRARY(normd_eager, m)
{
	m.def("norm(Tensor input, Tensor? weight, Tensor? bias, int[] normalized_shape, "
	      "float eps, bool rms, bool memory_efficient, int handle) -> Tensor",
	      &norm);
	m.def("bind(int enqueue_device, int last_error, int status_name, bool host_tensors) -> ()",
	      &bind);
	m.def("jobs() -> int", &jobs);
	m.def("conn_opened(int handle) -> ()", &conn_opened);
	m.def("conn_closed(int handle) -> ()", &conn_closed);
}
