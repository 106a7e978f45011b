// normd.normalization's enqueue mode in C++ (normd/eager.py builds and loads it):
//   - normd_eager::norm, one PyTorch operator whose autograd is C++, for eager
//     calls: checks, outputs, the autograd node and the library's enqueue
//     without the Python interpreter in between;
//   - C++ kernels (CUDA) of normd's torch.library ops, which compiled code calls.
// PyTorch's operator and autograd API is C++ only. The library is reached
// through the function pointers of the libnormclient the package loaded.
// Whatever this file does not take goes to the Python path.
//
// The eager operator's errors travel as RuntimeError messages that
// normd/eager.py parses:
//   "normd-eager fallback: why"   a case left to the Python path (which raises
//                                 its own errors);
//   "normd error CODE (NAME): message"   the library refused the job.
#include <atomic>
#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include <pthread.h>
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
using enqueue_device_ext_fn = int (*)(nc_conn *, const struct nc_job *,
				      const struct nc_job_ext *,
				      const void *const[NC_JOB_ALL_TENSORS], void *);
using text_fn = const char *(*)(int);
using last_error_fn = const char *(*)(void);

// libnormclient's entry points, from the copy the Python package loaded.
std::atomic<enqueue_device_fn> enqueue_device{nullptr};
// nullptr until bind_variants: the variants then stay on the Python path.
std::atomic<enqueue_device_ext_fn> enqueue_device_ext{nullptr};
std::atomic<last_error_fn> last_error{nullptr};
std::atomic<text_fn> status_name{nullptr};
// Jobs this operator enqueued, for tests that check which path ran.
std::atomic<int64_t> jobs_enqueued{0};
// Host tensors pass for device ones (bench/bench_host_path.py's stub, no GPU).
std::atomic<bool> accept_host{false};

// Connections the Python package opened and has not closed, with the process
// that opened them: a closed or inherited handle must never reach the library.
// Never destroyed (threads may still call in while static destructors run at
// exit); a forked child gets a fresh lock (its parent's may have been held).
std::mutex *conns_lock = new std::mutex;
auto &conns = *new std::unordered_map<int64_t, pid_t>;
// Client keys (0: the default client) -> connection handles, under conns_lock.
auto &client_keys = *new std::unordered_map<int64_t, int64_t>;
const int fork_handler = pthread_atfork(nullptr, nullptr, [] { conns_lock = new std::mutex; });

// Raises RuntimeError(message), formatted here with no ostream in between:
// errors raised with TORCH_CHECK's streamed ints crashed the process on a GPU
// machine whose c++ was /opt/gcc's g++ (BENCHMARKS.md, the compiled eager path).
[[noreturn]] __attribute__((format(printf, 1, 2))) void throw_error(const char *format, ...)
{
	char message[1024];
	va_list args;
	va_start(args, format);
	vsnprintf(message, sizeof message, format, args);
	va_end(args);
	TORCH_CHECK(false, static_cast<const char *>(message));
}

[[noreturn]] void fallback(const char *why)
{
	throw_error("normd-eager fallback: %s", why);
}

[[noreturn]] void library_error(int rc)
{
	const char *name = status_name.load()(rc);
	const char *message = last_error.load()();
	throw_error("normd error %d (%s): %s", rc, name ? name : "?", message ? message : "");
}

nc_conn *live_conn(int64_t handle)
{
	std::lock_guard<std::mutex> hold(*conns_lock);
	auto it = conns.find(handle);
	if (it == conns.end() || it->second != getpid())
		throw_error("normd error %d (INVALID_ARGUMENT): the client is closed, or was opened by "
		      "another process (a forked child must open its own normd.Client)",
		      static_cast<int>(NC_EINVALID_ARGUMENT));
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

// Thrown where this file leaves a call to the Python implementation.
struct Fallback {
	const char *why;
};

// After the library's call: a refusal raised (a capturing stream a Fallback where
// the caller can hand the call to Python), else one job more enqueued.
void enqueued(int rc, bool capture_falls_back)
{
	if (rc && capture_falls_back && rc == NC_EUNSUPPORTED) {
		static const char capturing[] = "the stream is capturing";
		const char *message = last_error.load()();
		if (message && strncmp(message, capturing, sizeof(capturing) - 1) == 0)
			throw Fallback{"the stream is capturing a CUDA graph"};
	}
	if (rc)
		library_error(rc);
	jobs_enqueued.fetch_add(1, std::memory_order_relaxed);
}

// A norm job's fields, its tensors absent.
struct nc_job norm_job(int op, uint64_t rows, uint64_t cols, double eps, int dtype,
		       int weight_dtype, unsigned flags)
{
	struct nc_job job = {};
	job.op = static_cast<enum nc_op>(op);
	job.rows = rows;
	job.cols = cols;
	job.eps = static_cast<float>(eps);
	job.dtype = static_cast<enum nc_dtype>(dtype);
	job.weight_dtype = static_cast<enum nc_dtype>(weight_dtype);
	job.flags = flags;
	return job;
}

// One job through the library; `t` in struct nc_job's role order. The
// library's refusal of a capturing stream is a Fallback where the caller can
// hand the call to Python (which words it for PyTorch users).
void enqueue(int64_t handle, const Tensor &on, int op, uint64_t rows, uint64_t cols, double eps,
	     int dtype, int weight_dtype, unsigned flags, const Tensor (&t)[10],
	     bool capture_falls_back)
{
	nc_conn *conn = live_conn(handle);
	struct nc_job job = norm_job(op, rows, cols, eps, dtype, weight_dtype, flags);
	const void *ptrs[NC_JOB_TENSORS] = {};
	for (int i = 0; i < 10; i++)
		ptrs[i] = ptr_or_null(t[i]);
	int rc = enqueue_device.load()(conn, &job, ptrs, current_stream(on));
	enqueued(rc, capture_falls_back);
}

// The shapes and dtypes normd.normalization's Python path accepts without
// converting anything; every other case is left to it.
void check_param(const Tensor &p, const Tensor &input, c10::IntArrayRef shape)
{
	if (p.defined() && (p.sizes() != shape || p.device() != input.device()))
		throw Fallback{"a parameter's shape or device"};
}

struct Plan {
	uint64_t rows, cols;
	int dtype, weight_dtype;
};

// `dtype` is the input's (the backward's saved tensor may be its output).
Plan plan(const Tensor &input, const Tensor &weight, const Tensor &bias, c10::IntArrayRef shape)
{
	Plan p{};
	p.dtype = dtype_code(input.scalar_type());
	if (!p.dtype || !(input.is_cuda() || accept_host.load()) || input.numel() == 0)
		throw Fallback{"not a CUDA tensor normd computes on"};
	const size_t n = shape.size();
	const auto dims = input.sizes();
	if (n == 0 || dims.size() < n || dims.slice(dims.size() - n) != shape)
		throw Fallback{"normalized_shape does not fit the input"};
	check_param(weight, input, shape);
	check_param(bias, input, shape);
	if (bias.defined() && (!weight.defined() || bias.scalar_type() != weight.scalar_type()))
		throw Fallback{"bias without weight, or of another dtype"};
	if (weight.defined() && weight.scalar_type() != input.scalar_type()) {
		if (weight.scalar_type() != at::kFloat)
			throw Fallback{"weights of another dtype than the input's or float32"};
		p.weight_dtype = NC_F32;
	}
	p.cols = 1;
	for (int64_t d : shape)
		p.cols *= static_cast<uint64_t>(d);
	p.rows = static_cast<uint64_t>(input.numel()) / p.cols;
	return p;
}

// A forward job: x (input made contiguous), y, LayerNorm's mean, invvar.
struct Forward {
	Plan p;
	Tensor x, weight, bias, y, mean, invvar;
};

Forward run_forward(const Tensor &input, const Tensor &weight_in, const Tensor &bias_in,
		    c10::IntArrayRef shape, double eps, bool rms, int64_t handle,
		    bool capture_falls_back)
{
	Forward f;
	f.weight = weight_in.defined() ? weight_in.contiguous() : Tensor();
	f.bias = bias_in.defined() ? bias_in.contiguous() : Tensor();
	f.p = plan(input, f.weight, f.bias, shape);
	f.x = input.contiguous();
	const auto stats = f.x.options().dtype(at::kFloat);
	const int64_t rows = static_cast<int64_t>(f.p.rows);
	f.y = at::empty(f.x.sizes(), f.x.options());
	f.mean = rms ? Tensor() : at::empty({rows}, stats);
	f.invvar = at::empty({rows}, stats);
	const Tensor tensors[10] = {f.x, f.y, f.mean, f.invvar, f.weight, f.bias, {}, {}, {}, {}};
	enqueue(handle, f.x, rms ? NC_RMSNORM_FWD : NC_LAYERNORM_FWD, f.p.rows, f.p.cols, eps,
		f.p.dtype, f.p.weight_dtype, 0, tensors, capture_falls_back);
	return f;
}

// A backward job's outputs: dx, and dgamma / dbeta where asked for (else undefined).
struct Backward {
	Tensor dx, dgamma, dbeta;
};

Backward run_backward(const Tensor &grad, const Tensor &x, const Tensor &weight,
		      const Tensor &bias, const Tensor &mean, const Tensor &invvar, uint64_t rows,
		      uint64_t cols, double eps, bool rms, bool memory_efficient, int weight_dtype,
		      bool want_dgamma, bool want_dbeta, int64_t handle, bool capture_falls_back)
{
	Tensor dy = grad.contiguous();
	if (dy.scalar_type() != x.scalar_type())
		dy = dy.to(x.scalar_type());
	Backward b;
	b.dx = at::empty(x.sizes(), x.options());
	b.dgamma = weight.defined() && want_dgamma ? at::empty(weight.sizes(), weight.options())
						   : Tensor();
	b.dbeta = bias.defined() && want_dbeta ? at::empty(bias.sizes(), bias.options()) : Tensor();
	const Tensor tensors[10] = {x, {}, mean, invvar, weight, bias, dy, b.dx, b.dgamma, b.dbeta};
	enqueue(handle, x, rms ? NC_RMSNORM_BWD : NC_LAYERNORM_BWD, rows, cols, eps,
		dtype_code(x.scalar_type()), weight_dtype,
		memory_efficient ? static_cast<unsigned>(NC_MEMORY_EFFICIENT) : 0u, tensors,
		capture_falls_back);
	return b;
}

// ---- the eager operator: normd_eager::norm, its autograd in C++ ----

// Differentiable once, as apex's norms are (Python's once_differentiable): with
// a graph asked for, the gradients lead to a node that raises if reached.
void once_differentiable(variable_list &out, bool graph)
{
	if (!graph)
		return;
	const size_t n = out.size();
	auto error = std::make_shared<torch::autograd::DelayedError>(
		"trying to differentiate twice a function that was marked with "
		"@once_differentiable (normd's norms are differentiable once)",
		static_cast<int64_t>(n));
	variable_list leaves;
	for (size_t i = 0; i < n; i++)
		leaves.push_back(out[i].defined() ? out[i].detach().requires_grad_(true) : Tensor());
	out = (*error)(std::move(leaves));
}

// The forward's ints a backward needs, in ctx->saved_data["job"].
enum {
	JOB_ROWS,
	JOB_COLS,
	JOB_RMS,
	JOB_MEMORY_EFFICIENT,
	JOB_WEIGHT_DTYPE,
	JOB_HANDLE,
	JOB_HAS_RESIDUAL /* the variants' operator only */
};

class NormFunction : public torch::autograd::Function<NormFunction> {
      public:
	// Absent parameters are empty optionals: autograd takes no undefined inputs.
	static Tensor forward(AutogradContext *ctx, const Tensor &input,
			      const std::optional<Tensor> &weight, const std::optional<Tensor> &bias,
			      c10::IntArrayRef shape, double eps, bool rms, bool memory_efficient,
			      int64_t handle)
	{
		Forward f;
		try {
			f = run_forward(input, weight ? *weight : Tensor(), bias ? *bias : Tensor(),
					shape, eps, rms, handle, false);
		} catch (const Fallback &why) {
			fallback(why.why);
		}
		// What apex saves: the input (the output with memory_efficient), the
		// parameters, LayerNorm's mean (not with memory_efficient), invvar.
		ctx->save_for_backward({memory_efficient ? f.y : f.x, f.weight, f.bias,
					memory_efficient ? Tensor() : f.mean, f.invvar});
		// Two entries rather than seven: each is a string-keyed insert.
		ctx->saved_data["job"] = std::vector<int64_t>{
			static_cast<int64_t>(f.p.rows), static_cast<int64_t>(f.p.cols), rms,
			memory_efficient, f.p.weight_dtype, handle};
		ctx->saved_data["eps"] = eps;
		return f.y;
	}

	static variable_list backward(AutogradContext *ctx, variable_list grads)
	{
		variable_list out = gradients(ctx, grads[0]);
		once_differentiable(out, at::GradMode::is_enabled() && grads[0].requires_grad());
		out.resize(8);
		return out;
	}

      private:
	// dx, dgamma, dbeta (those not asked for undefined), computed without a graph.
	static variable_list gradients(AutogradContext *ctx, const Tensor &grad)
	{
		at::NoGradGuard no_graph;
		const auto saved = ctx->get_saved_variables();
		const auto job = ctx->saved_data["job"].toIntVector();
		// needs_input_grad counts the inputs that are tensors: ask only of those.
		const bool want_dgamma = saved[1].defined() && ctx->needs_input_grad(1);
		const bool want_dbeta = saved[2].defined() && ctx->needs_input_grad(2);
		Backward b = run_backward(grad, saved[0], saved[1], saved[2], saved[3], saved[4],
					  static_cast<uint64_t>(job[JOB_ROWS]),
					  static_cast<uint64_t>(job[JOB_COLS]),
					  ctx->saved_data["eps"].toDouble(), job[JOB_RMS] != 0,
					  job[JOB_MEMORY_EFFICIENT] != 0,
					  static_cast<int>(job[JOB_WEIGHT_DTYPE]), want_dgamma, want_dbeta,
					  job[JOB_HANDLE], false);
		return {b.dx, b.dgamma, b.dbeta};
	}
};

Tensor norm(const Tensor &input, const std::optional<Tensor> &weight,
	    const std::optional<Tensor> &bias, c10::IntArrayRef normalized_shape, double eps,
	    bool rms, bool memory_efficient, int64_t handle)
{
	return NormFunction::apply(input, weight, bias, normalized_shape, eps, rms, memory_efficient,
				   handle);
}

// ---- the variants' eager operator: normd_eager::variant_norm ----
//
// The residual add and the weight offset (normalization/variants.py's
// FusedNormVariantFunction, whose jobs these are, field for field): s =
// input + residual, y = norm(s or input) * (weight_offset + weight) [+ bias].
// FP8 output and the in-place forms have no autograd and stay in Python.

// One job with variants through nc_job_enqueue_device_ext; `t` in role order.
void enqueue_variant(int64_t handle, const Tensor &on, int op, uint64_t rows, uint64_t cols,
		     double eps, int dtype, int weight_dtype, unsigned flags, double weight_offset,
		     const Tensor (&t)[NC_JOB_ALL_TENSORS], bool capture_falls_back)
{
	const auto call = enqueue_device_ext.load();
	if (!call)
		throw Fallback{"the library's nc_job_enqueue_device_ext is not bound"};
	nc_conn *conn = live_conn(handle);
	struct nc_job job = norm_job(op, rows, cols, eps, dtype, weight_dtype, flags);
	struct nc_job_ext ext = {};
	ext.weight_offset = static_cast<float>(weight_offset);
	const void *ptrs[NC_JOB_ALL_TENSORS] = {};
	for (int i = 0; i < NC_JOB_ALL_TENSORS; i++)
		ptrs[i] = ptr_or_null(t[i]);
	enqueued(call(conn, &job, &ext, ptrs, current_stream(on)), capture_falls_back);
}

// The roles of struct nc_job_ext after struct nc_job's ten norm roles and main_grad.
enum { ROLE_RESIDUAL = NC_JOB_TENSORS, ROLE_RESIDUAL_OUT, ROLE_DS };

struct VariantForward {
	Plan p;
	Tensor x, weight, bias, y, s, mean, invvar;
};

VariantForward run_variant_forward(const Tensor &input, const Tensor &residual_in,
				   const Tensor &weight_in, const Tensor &bias_in,
				   c10::IntArrayRef shape, double eps, bool rms, double weight_offset,
				   int64_t handle, bool capture_falls_back)
{
	VariantForward f;
	f.weight = weight_in.defined() ? weight_in.contiguous() : Tensor();
	f.bias = bias_in.defined() ? bias_in.contiguous() : Tensor();
	f.p = plan(input, f.weight, f.bias, shape);
	if (residual_in.defined() &&
	    (residual_in.sizes() != input.sizes() ||
	     residual_in.scalar_type() != input.scalar_type() ||
	     residual_in.device() != input.device()))
		throw Fallback{"a residual of another shape, dtype or device"};
	if (weight_offset != 0.0 && !f.weight.defined())
		throw Fallback{"a weight offset without a weight"};
	f.x = input.contiguous();
	const Tensor r = residual_in.defined() ? residual_in.contiguous() : Tensor();
	const auto stats = f.x.options().dtype(at::kFloat);
	const int64_t rows = static_cast<int64_t>(f.p.rows);
	f.y = at::empty(f.x.sizes(), f.x.options());
	f.s = r.defined() ? at::empty(f.x.sizes(), f.x.options()) : Tensor();
	f.mean = rms ? Tensor() : at::empty({rows}, stats);
	f.invvar = at::empty({rows}, stats);
	Tensor t[NC_JOB_ALL_TENSORS] = {f.x, f.y, f.mean, f.invvar, f.weight, f.bias};
	t[ROLE_RESIDUAL] = r;
	t[ROLE_RESIDUAL_OUT] = f.s;
	enqueue_variant(handle, f.x, rms ? NC_RMSNORM_FWD : NC_LAYERNORM_FWD, f.p.rows, f.p.cols,
			eps, f.p.dtype, f.p.weight_dtype, 0, weight_offset, t, capture_falls_back);
	return f;
}

struct VariantBackward {
	Tensor dx, dgamma, dbeta;
};

// dx = dnorm(x) + ds (the gradient of both input and residual), dgamma and dbeta
// where wanted (else undefined), for the saved x. Without grad_y only s was used:
// dx is grad_s. For an op's kernel (`kernel`) dx is then a copy (an op's outputs
// alias none of its inputs) and a capturing stream goes back to Python.
VariantBackward run_variant_backward(const Tensor &grad_y, const Tensor &grad_s, const Tensor &x,
				     const Tensor &weight, const Tensor &bias, const Tensor &mean,
				     const Tensor &invvar, uint64_t rows, uint64_t cols, double eps,
				     bool rms, double weight_offset, bool memory_efficient,
				     int weight_dtype, bool want_dgamma, bool want_dbeta,
				     int64_t handle, bool kernel)
{
	VariantBackward b;
	if (!grad_y.defined()) {
		if (grad_s.defined())
			b.dx = kernel ? grad_s.to(x.scalar_type(), false, true,
						  at::MemoryFormat::Contiguous)
				      : grad_s.to(x.scalar_type()).contiguous();
		b.dgamma = want_dgamma ? at::zeros_like(weight) : Tensor();
		b.dbeta = want_dbeta ? at::zeros_like(bias) : Tensor();
		return b;
	}
	const Tensor dy = grad_y.to(x.scalar_type()).contiguous();
	const Tensor ds = grad_s.defined() ? grad_s.to(x.scalar_type()).contiguous() : Tensor();
	b.dx = at::empty(x.sizes(), x.options());
	b.dgamma = want_dgamma ? at::empty(weight.sizes(), weight.options()) : Tensor();
	b.dbeta = want_dbeta ? at::empty(bias.sizes(), bias.options()) : Tensor();
	Tensor t[NC_JOB_ALL_TENSORS] = {x, Tensor(), mean, invvar, weight, bias, dy, b.dx, b.dgamma,
					b.dbeta};
	t[ROLE_DS] = ds;
	enqueue_variant(handle, x, rms ? NC_RMSNORM_BWD : NC_LAYERNORM_BWD, rows, cols, eps,
			dtype_code(x.scalar_type()), weight_dtype,
			memory_efficient ? static_cast<unsigned>(NC_MEMORY_EFFICIENT) : 0u,
			weight_offset, t, kernel);
	return b;
}

class VariantFunction : public torch::autograd::Function<VariantFunction> {
      public:
	// Returns (y, s); s is an empty tensor without residual (an op returns no None).
	static variable_list forward(AutogradContext *ctx, const Tensor &input,
				     const std::optional<Tensor> &residual,
				     const std::optional<Tensor> &weight,
				     const std::optional<Tensor> &bias, c10::IntArrayRef shape,
				     double eps, bool rms, double weight_offset,
				     bool memory_efficient, int64_t handle)
	{
		VariantForward f;
		try {
			f = run_variant_forward(input, residual ? *residual : Tensor(),
						weight ? *weight : Tensor(), bias ? *bias : Tensor(),
						shape, eps, rms, weight_offset, handle, false);
		} catch (const Fallback &why) {
			fallback(why.why);
		}
		ctx->set_materialize_grads(false);
		const bool has_residual = f.s.defined();
		// What FusedNormVariantFunction saves: s (the input without residual),
		// or y with memory_efficient; the parameters; mean, invvar.
		const Tensor saved = memory_efficient ? f.y : has_residual ? f.s : f.x;
		ctx->save_for_backward({saved, f.weight, f.bias,
					memory_efficient ? Tensor() : f.mean, f.invvar});
		ctx->saved_data["job"] = std::vector<int64_t>{
			static_cast<int64_t>(f.p.rows), static_cast<int64_t>(f.p.cols), rms,
			memory_efficient, f.p.weight_dtype, handle, has_residual};
		ctx->saved_data["eps"] = eps;
		ctx->saved_data["weight_offset"] = weight_offset;
		// Without residual s is a placeholder whose gradient backward ignores (not
		// marked non-differentiable: compiled autograd refuses nodes that mark any).
		return {f.y, has_residual ? f.s : at::empty({0}, f.x.options())};
	}

	static variable_list backward(AutogradContext *ctx, variable_list grads)
	{
		variable_list out = gradients(ctx, grads[0], grads[1]);
		once_differentiable(out, at::GradMode::is_enabled() &&
						 ((grads[0].defined() && grads[0].requires_grad()) ||
						  (grads[1].defined() && grads[1].requires_grad())));
		out.resize(10);
		return out;
	}

      private:
	// d_input, d_residual (the same dx), dgamma, dbeta; those not asked for undefined.
	static variable_list gradients(AutogradContext *ctx, const Tensor &grad_y,
				       const Tensor &grad_s)
	{
		at::NoGradGuard no_graph;
		const auto saved = ctx->get_saved_variables();
		const auto job = ctx->saved_data["job"].toIntVector();
		const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
		const bool has_residual = job[JOB_HAS_RESIDUAL] != 0;
		// needs_input_grad counts the tensors given, absent optionals not: input,
		// then the residual, weight and bias that are there.
		const size_t residual_edge = 1, weight_edge = has_residual ? 2 : 1;
		const size_t bias_edge = weight_edge + (weight.defined() ? 1 : 0);
		const bool want_dgamma = weight.defined() && ctx->needs_input_grad(weight_edge);
		const bool want_dbeta = bias.defined() && ctx->needs_input_grad(bias_edge);
		VariantBackward b;
		try {
			b = run_variant_backward(
				grad_y, has_residual ? grad_s : Tensor(), x, weight, bias, saved[3],
				saved[4],
				static_cast<uint64_t>(job[JOB_ROWS]), static_cast<uint64_t>(job[JOB_COLS]),
				ctx->saved_data["eps"].toDouble(), job[JOB_RMS] != 0,
				ctx->saved_data["weight_offset"].toDouble(), job[JOB_MEMORY_EFFICIENT] != 0,
				static_cast<int>(job[JOB_WEIGHT_DTYPE]), want_dgamma, want_dbeta,
				job[JOB_HANDLE], false);
		} catch (const Fallback &why) {
			throw_error("normd error %d (INVALID_ARGUMENT): %s",
				    static_cast<int>(NC_EINVALID_ARGUMENT), why.why);
		}
		const Tensor &dx = b.dx, &dgamma = b.dgamma, &dbeta = b.dbeta;
		return {ctx->needs_input_grad(0) ? dx : Tensor(),
			has_residual && ctx->needs_input_grad(residual_edge) ? dx : Tensor(), dgamma,
			dbeta};
	}
};

std::tuple<Tensor, Tensor> variant_norm(const Tensor &input, const std::optional<Tensor> &residual,
					const std::optional<Tensor> &weight,
					const std::optional<Tensor> &bias,
					c10::IntArrayRef normalized_shape, double eps, bool rms,
					double weight_offset, bool memory_efficient, int64_t handle)
{
	variable_list out = VariantFunction::apply(input, residual, weight, bias, normalized_shape,
						   eps, rms, weight_offset, memory_efficient, handle);
	return {out[0], out[1]};
}

// ---- the kernels of normd.normalization's torch.library ops ----
//
// Under torch.compile the modules call normd::{layer,rms}_norm_{fwd,bwd}
// (normalization/custom_ops.py: schemas, fake implementations, autograd, and
// the Python implementation as the CompositeExplicitAutograd kernel). The
// kernels here, for CUDA (and host tensors under the stub), run the enqueue
// mode's common case in C++ and hand every other call, untouched, to that
// Python implementation: another completion mode, a client key Python has
// not told us, the mixed forms' float32 copies, arguments it would refuse.

// set_completion_mode() as Python last told it: -1 none ($NORMD_COMPLETION
// decides), 0 the enqueue mode, 1 another.
std::atomic<int> mode_setting{-1};

bool enqueue_mode()
{
	const int setting = mode_setting.load(std::memory_order_relaxed);
	if (setting >= 0)
		return setting == 0;
	const char *env = getenv("NORMD_COMPLETION");
	if (!env)
		return true;
	std::string mode;
	for (const char *c = env; *c; c++)
		if (!isspace(static_cast<unsigned char>(*c)))
			mode.push_back(static_cast<char>(tolower(static_cast<unsigned char>(*c))));
	return mode.empty() || mode == "enqueue";
}

// The handle of the client a key names, or 0 where the Python kernel must run.
int64_t compiled_handle(int64_t key)
{
	if (!enqueue_mode())
		return 0;
	std::lock_guard<std::mutex> hold(*conns_lock);
	auto k = client_keys.find(key);
	if (k == client_keys.end())
		return 0;
	auto c = conns.find(k->second);
	return c != conns.end() && c->second == getpid() ? k->second : 0;
}

void python_kernel(const c10::OperatorHandle &op, torch::jit::Stack *stack)
{
	c10::Dispatcher::singleton().callBoxedForDispatchKey(
		op, c10::DispatchKey::CompositeExplicitAutograd, stack);
}

Tensor optional_tensor(const c10::IValue &v)
{
	return v.isNone() ? Tensor() : v.toTensor();
}

std::vector<int64_t> int_list(const c10::IValue &v)
{
	if (v.isIntList())
		return v.toIntVector();
	std::vector<int64_t> out;
	for (const c10::SymInt &d : v.toSymIntVector())
		out.push_back(d.expect_int());
	return out;
}

// normd::layer_norm_fwd(input, weight?, bias?, normalized_shape, eps, mixed,
// memory_efficient, client) -> (y, mean, invvar); rms_norm_fwd without bias
// and mean.
template <bool RMS>
void forward_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack)
{
	constexpr size_t n = RMS ? 7 : 8, shape_at = RMS ? 2 : 3;
	const auto args = torch::jit::last(*stack, n);
	const Tensor input = args[0].toTensor();
	const Tensor weight = optional_tensor(args[1]);
	const Tensor bias = RMS ? Tensor() : optional_tensor(args[2]);
	const bool upcast = args[shape_at + 2].toBool() && weight.defined() &&
			    weight.scalar_type() != input.scalar_type();
	const int64_t handle = upcast ? 0 : compiled_handle(args[shape_at + 4].toInt());
	if (!handle)
		return python_kernel(op, stack);
	Forward f;
	try {
		f = run_forward(input, weight, bias, int_list(args[shape_at]),
				args[shape_at + 1].toDouble(), RMS, handle, true);
	} catch (const Fallback &) {
		return python_kernel(op, stack);
	}
	torch::jit::drop(*stack, n);
	torch::jit::push(*stack, f.y);
	if (!RMS)
		torch::jit::push(*stack, f.mean);
	torch::jit::push(*stack, f.invvar);
}

bool fits(const Tensor &t, const Tensor &like, int64_t elements, bool stats)
{
	return t.numel() == elements && t.device() == like.device() &&
	       (!stats || (t.scalar_type() == at::kFloat && t.is_contiguous()));
}

// normd::layer_norm_bwd(grad_output, saved, weight?, bias?, mean?, invvar,
// normalized_shape, eps, mixed, memory_efficient, input_dtype, weight_grad,
// bias_grad, client) -> (dx, dgamma, dbeta); rms_norm_bwd without bias, mean,
// bias_grad and dbeta. A gradient not asked for is an empty float32 tensor.
template <bool RMS>
void backward_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack)
{
	constexpr size_t n = RMS ? 11 : 14, shape_at = RMS ? 4 : 6;
	const auto args = torch::jit::last(*stack, n);
	const Tensor grad = args[0].toTensor(), saved = args[1].toTensor();
	const Tensor weight = optional_tensor(args[2]);
	const Tensor bias = RMS ? Tensor() : optional_tensor(args[3]);
	const Tensor mean = RMS ? Tensor() : optional_tensor(args[4]);
	const Tensor invvar = args[RMS ? 3 : 5].toTensor();
	const std::vector<int64_t> shape = int_list(args[shape_at]);
	const double eps = args[shape_at + 1].toDouble();
	const bool mixed = args[shape_at + 2].toBool();
	const bool memory_efficient = args[shape_at + 3].toBool();
	const at::ScalarType input_dtype = args[shape_at + 4].toScalarType();
	const bool weight_grad = args[shape_at + 5].toBool();
	const bool bias_grad = RMS ? false : args[shape_at + 6].toBool();
	const int64_t key = args[n - 1].toInt();
	// What the Python implementation would convert or check first goes there.
	const bool upcast = mixed && weight.defined() && weight.scalar_type() != input_dtype;
	const int64_t handle = upcast || saved.scalar_type() != input_dtype ||
					       (memory_efficient && mean.defined())
				       ? 0
				       : compiled_handle(key);
	if (!handle)
		return python_kernel(op, stack);
	Backward b;
	try {
		const Plan p = plan(saved, weight, bias, shape);
		const int64_t rows = static_cast<int64_t>(p.rows), cols = static_cast<int64_t>(p.cols);
		if (!fits(grad, saved, rows * cols, false) || !fits(invvar, saved, rows, true) ||
		    (!RMS && !memory_efficient && !(mean.defined() && fits(mean, saved, rows, true))))
			throw Fallback{"the backward's tensors do not fit"};
		b = run_backward(grad, saved.contiguous(),
				 weight.defined() ? weight.contiguous() : Tensor(),
				 bias.defined() ? bias.contiguous() : Tensor(),
				 memory_efficient ? Tensor() : mean, invvar, p.rows, p.cols, eps, RMS,
				 memory_efficient, p.weight_dtype, weight_grad, bias_grad, handle, true);
	} catch (const Fallback &) {
		return python_kernel(op, stack);
	}
	const auto none = [&] { return at::empty({0}, invvar.options()); };
	torch::jit::drop(*stack, n);
	torch::jit::push(*stack, b.dx);
	torch::jit::push(*stack, b.dgamma.defined() ? b.dgamma : none());
	if (!RMS)
		torch::jit::push(*stack, b.dbeta.defined() ? b.dbeta : none());
}

// normd::norm_variant_fwd(input, residual?, weight?, bias?, normalized_shape, eps,
// rms, weight_offset, memory_efficient, client) -> (y, s, mean, invvar): s empty
// without residual, mean empty for RMSNorm (normalization/variant_ops.py).
void variant_forward_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet,
			    torch::jit::Stack *stack)
{
	constexpr size_t n = 10;
	const auto args = torch::jit::last(*stack, n);
	const int64_t handle = compiled_handle(args[9].toInt());
	if (!handle)
		return python_kernel(op, stack);
	const Tensor input = args[0].toTensor();
	VariantForward f;
	try {
		f = run_variant_forward(input, optional_tensor(args[1]), optional_tensor(args[2]),
					optional_tensor(args[3]), int_list(args[4]), args[5].toDouble(),
					args[6].toBool(), args[7].toDouble(), handle, true);
	} catch (const Fallback &) {
		return python_kernel(op, stack);
	}
	torch::jit::drop(*stack, n);
	torch::jit::push(*stack, f.y);
	torch::jit::push(*stack, f.s.defined() ? f.s : at::empty({0}, input.options()));
	torch::jit::push(*stack, f.mean.defined() ? f.mean : at::empty({0}, f.invvar.options()));
	torch::jit::push(*stack, f.invvar);
}

// normd::norm_variant_bwd(grad_y?, grad_s?, saved, weight?, bias?, mean?, invvar,
// normalized_shape, eps, rms, weight_offset, memory_efficient, weight_grad,
// bias_grad, client) -> (dx, dgamma, dbeta), those not asked for empty float32.
void variant_backward_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet,
			     torch::jit::Stack *stack)
{
	constexpr size_t n = 15;
	const auto args = torch::jit::last(*stack, n);
	const int64_t handle = compiled_handle(args[14].toInt());
	if (!handle)
		return python_kernel(op, stack);
	const Tensor grad_y = optional_tensor(args[0]), grad_s = optional_tensor(args[1]);
	const Tensor invvar = args[6].toTensor();
	const bool rms = args[9].toBool(), memory_efficient = args[11].toBool();
	VariantBackward b;
	try {
		const Tensor saved = args[2].toTensor().contiguous();
		const Tensor weight = optional_tensor(args[3]), bias = optional_tensor(args[4]);
		const Tensor w = weight.defined() ? weight.contiguous() : Tensor();
		const Tensor bi = bias.defined() ? bias.contiguous() : Tensor();
		const Tensor mean = optional_tensor(args[5]);
		const Plan p = plan(saved, w, bi, int_list(args[7]));
		const int64_t rows = static_cast<int64_t>(p.rows), cols = static_cast<int64_t>(p.cols);
		if ((grad_y.defined() && !fits(grad_y, saved, rows * cols, false)) ||
		    (grad_s.defined() && !fits(grad_s, saved, rows * cols, false)) ||
		    (!grad_y.defined() && !grad_s.defined()) || !fits(invvar, saved, rows, true) ||
		    (mean.defined() && !fits(mean, saved, rows, true)) ||
		    (grad_y.defined() && !rms && !memory_efficient && !mean.defined()))
			throw Fallback{"the backward's tensors do not fit"};
		b = run_variant_backward(grad_y, grad_s, saved, w, bi, mean, invvar, p.rows, p.cols,
					 args[8].toDouble(), rms, args[10].toDouble(),
					 memory_efficient, p.weight_dtype,
					 args[12].toBool() && w.defined(),
					 args[13].toBool() && bi.defined(), handle, true);
	} catch (const Fallback &) {
		return python_kernel(op, stack);
	}
	const auto none = [&] { return at::empty({0}, invvar.options()); };
	torch::jit::drop(*stack, n);
	torch::jit::push(*stack, b.dx);
	torch::jit::push(*stack, b.dgamma.defined() ? b.dgamma : none());
	torch::jit::push(*stack, b.dbeta.defined() ? b.dbeta : none());
}

// ---- what the Python package tells the operator ----

void bind(int64_t enqueue_device_addr, int64_t last_error_addr, int64_t status_name_addr,
	  bool host_tensors)
{
	accept_host.store(host_tensors);
	enqueue_device.store(reinterpret_cast<enqueue_device_fn>(enqueue_device_addr));
	last_error.store(reinterpret_cast<last_error_fn>(last_error_addr));
	status_name.store(reinterpret_cast<text_fn>(status_name_addr));
}

// nc_job_enqueue_device_ext, for the variants' operator (0: they stay on the Python path).
void bind_variants(int64_t enqueue_device_ext_addr)
{
	enqueue_device_ext.store(reinterpret_cast<enqueue_device_ext_fn>(enqueue_device_ext_addr));
}

int64_t jobs()
{
	return jobs_enqueued.load(std::memory_order_relaxed);
}

void conn_opened(int64_t handle)
{
	std::lock_guard<std::mutex> hold(*conns_lock);
	conns[handle] = getpid();
}

void conn_closed(int64_t handle)
{
	std::lock_guard<std::mutex> hold(*conns_lock);
	conns.erase(handle);
	for (auto it = client_keys.begin(); it != client_keys.end();)
		it = it->second == handle ? client_keys.erase(it) : std::next(it);
}

// A client key's connection (0: forget the key).
void client_key(int64_t key, int64_t handle)
{
	std::lock_guard<std::mutex> hold(*conns_lock);
	if (handle)
		client_keys[key] = handle;
	else
		client_keys.erase(key);
}

// set_completion_mode(): "" (none), or the mode.
void completion_mode(c10::string_view mode)
{
	mode_setting.store(mode.empty() ? -1 : mode == "enqueue" ? 0 : 1);
}

} // namespace

TORCH_LIBRARY(normd_eager, m)
{
	m.def("norm(Tensor input, Tensor? weight, Tensor? bias, int[] normalized_shape, "
	      "float eps, bool rms, bool memory_efficient, int handle) -> Tensor",
	      &norm);
	m.def("bind(int enqueue_device, int last_error, int status_name, bool host_tensors) -> ()",
	      &bind);
	m.def("variant_norm(Tensor input, Tensor? residual, Tensor? weight, Tensor? bias, "
	      "int[] normalized_shape, float eps, bool rms, float weight_offset, "
	      "bool memory_efficient, int handle) -> (Tensor, Tensor)",
	      &variant_norm);
	m.def("bind_variants(int enqueue_device_ext) -> ()", &bind_variants);
	m.def("jobs() -> int", &jobs);
	m.def("conn_opened(int handle) -> ()", &conn_opened);
	m.def("conn_closed(int handle) -> ()", &conn_closed);
	m.def("client_key(int key, int handle) -> ()", &client_key);
	m.def("completion_mode(str mode) -> ()", &completion_mode);
}

TORCH_LIBRARY_IMPL(normd, CUDA, m)
{
	m.impl("layer_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&forward_kernel<false>>());
	m.impl("rms_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&forward_kernel<true>>());
	m.impl("layer_norm_bwd", torch::CppFunction::makeFromBoxedFunction<&backward_kernel<false>>());
	m.impl("rms_norm_bwd", torch::CppFunction::makeFromBoxedFunction<&backward_kernel<true>>());
	m.impl("norm_variant_fwd",
	       torch::CppFunction::makeFromBoxedFunction<&variant_forward_kernel>());
	m.impl("norm_variant_bwd",
	       torch::CppFunction::makeFromBoxedFunction<&variant_backward_kernel>());
}

// Host tensors: the Python kernel, but under the stub (accept_host), whose tests compare the two.
TORCH_LIBRARY_IMPL(normd, CPU, m)
{
	m.impl("layer_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&forward_kernel<false>>());
	m.impl("rms_norm_fwd", torch::CppFunction::makeFromBoxedFunction<&forward_kernel<true>>());
	m.impl("layer_norm_bwd", torch::CppFunction::makeFromBoxedFunction<&backward_kernel<false>>());
	m.impl("rms_norm_bwd", torch::CppFunction::makeFromBoxedFunction<&backward_kernel<true>>());
	m.impl("norm_variant_fwd",
	       torch::CppFunction::makeFromBoxedFunction<&variant_forward_kernel>());
	m.impl("norm_variant_bwd",
	       torch::CppFunction::makeFromBoxedFunction<&variant_backward_kernel>());
}
