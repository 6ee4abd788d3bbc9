// The dump's capture hot path in C: a Python extension module (llmflow_capture) of two types,
// each the C half of a Python class that derives from it.
//
// A statistics dump makes one index row per leaf of every call it records: ~1,200 a decode step
// of SmolLM2 by modules, ~4,100 by torch API. In Python each row is a dozen attribute reads, a
// dictionary look-up, a kernel call through ctypes and a tuple of fifteen fields (~3.5 us), each
// call's values are walked by a Python loop, and API mode's __torch_function__ runs for every
// torch call. Here the same work is ~3x faster; an API statistics dump of SmolLM2 measured ~1.5x
// of plain generation against ~1.65x with the Python methods (docs/benchmarks.md).
//
// Entries (capture.py's DumpSession derives from it): the session's counters (step, order,
// entries, bytes, stopped: plain attributes from Python), the recorder's sink methods
// (module_inputs, module_output, op_inputs, op_output), which walk a call's values exactly as
// recorder.py's walk_inputs / walk_output / _walk do, label for label, and the walk's leaves:
//   tensor: a plain torch.Tensor seen again unchanged this step (same object, same version
//     counter): an index row pointing at that capture's key; in a statistics dump, a contiguous
//     CPU tensor of a kernel dtype (stats.cpp): its statistics now, from the statistics kernel
//     (called directly, not through ctypes), and its index row; in a tensor dump without CRC32,
//     a contiguous CPU tensor: its bytes now, and its row to the writer; any other plain tensor
//     (a view that is not contiguous, a tensor on an accelerator, a dtype the kernel lacks): its
//     row, and a copy from copies.py's device_copy / host_copy to the writer;
//   other: None, a bool, an int, a float or a string as its value; a torch dtype by its name; a
//     Parameter by shape, dtype and name; a value of any type the session's _other does not
//     single out (a model's cache object, say) by its type's name.
// Every other leaf (a tensor subclass or one without a version counter, an empty tensor, one
// that requires grad, a dtype safetensors cannot store, a CRC32 dump's copies, the max_bytes
// limit, a subclass of int, float or str, a torch device, layout or memory format) goes to the
// session's own Python method (_tensor / _other) before
// anything here has changed, so the Python methods stay the one definition of an entry; tests
// check that both write the same dump byte for byte (tests/unit/test_dump_native_capture.py).
//
// Dispatch (api.py's ApiMode derives from it, and from torch's TorchFunctionMode): its
// __torch_function__, the same steps as ApiMode._dispatch.
//
// A tensor's metadata (version counter, device, contiguity, element and byte counts, data pointer,
// sizes, requires_grad, layout, lazy negation or conjugation) comes from tensor_meta.cpp's reader,
// one C++ call, where it is built; else, and for every tensor it declines, through torch's Python
// bindings: the same values either way.
//
// Built by llmflow.native against this interpreter's headers (once per Python version), loaded
// as an extension module; where it cannot be built, the Python methods do everything.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {

typedef void (*StatsKernel)(const void *, int, int64_t, double *);

// tensor_meta.cpp's TensorMeta, field for field (its size asserted in both files and in
// tensor_meta.py's mirror), and its reader: 1 read, 0 left to the Python bindings
constexpr int META_DIMS = 8;
struct TensorMeta {
    int64_t version, numel, nbytes;
    void *data;
    int64_t sizes[META_DIMS];
    int32_t ndim;
    int8_t has_version, is_cpu, contiguous, requires_grad, strided, is_neg, is_conj;
};
static_assert(sizeof(TensorMeta) == 112, "TensorMeta changed: change tensor_meta.cpp and tensor_meta.py too");
typedef int (*MetaReader)(PyObject *, TensorMeta *);

constexpr long long STATS_ENTRY_BYTES = 256;  // capture.py's _STATS_ENTRY_BYTES
constexpr int N_STATS = 6;                   // STAT_KEYS

PyObject *s_version, *s_dtype, *s_is_cpu, *s_is_contiguous, *s_numel, *s_data_ptr, *s_shape, *s_layout,
    *s_is_neg, *s_is_conj, *s_nbytes, *s_requires_grad,
    *s_tensor_slow, *s_other_slow, *s_empty, *s_param_dtype, *s_param, *s_parameter, *s_enter, *s_exit,
    *s_input, *s_output, *s_module, *s_api;
PyObject *pytype_none, *pytype_bool, *pytype_int, *pytype_float, *pytype_dtype, *pytype_str, *s_name;

struct Entries {
    PyObject_HEAD
    long long step, order, entries, bytes;
    PyObject *stopped;       // None, or why capture stopped (max_bytes)
    PyObject *seen;          // id(tensor) -> (weakref, version, dtype, shape, has_data, key)
    PyObject *add_row;       // the writer's add_row: an index row and nothing more
    PyObject *add_finite_row;  // the writer's add_finite_row: the same, for a row whose floats are finite
    PyObject *submit;        // the writer's submit: a row with data (IndexRow, payload, event, nbytes)
    PyObject *index_row;     // IndexRow (the rows submit takes)
    PyObject *strided;       // torch.strided
    PyObject *dtype_names;   // torch.dtype -> its name in the index
    PyObject *kernel_codes;  // torch.dtype -> stats.cpp's code
    PyObject *no_extra;      // the shared empty ``extra`` dict
    PyObject *tensor_type;   // torch.Tensor
    PyObject *parameter_type;  // torch.nn.Parameter
    PyObject *dtype_type;    // torch.dtype
    PyObject *param_names;   // id(parameter) -> its name in the model
    PyObject *disable_torch_function;  // torch._C.DisableTorchFunction
    PyObject *copy;          // copies.device_copy / host_copy: (payload, event) of a tensor; None: none here (CRC32)
    PyObject *other_in_python;  // the types of the values whose rows only the session's _other makes
    int op_inputs, op_outputs;  // an API dump records the ops' inputs / outputs (tensor_part)
    StatsKernel kernel;      // null: no statistics here (tensor mode, no kernel, CRC32)
    MetaReader meta_reader;  // null: tensors read through torch's Python bindings
    int statistics;          // a statistics dump
    long long max_bytes;     // -1: no limit
    int record_repeats;      // register first captures in ``seen`` (a plain dict; not _NoRepeats)
    int data;                // a tensor dump without CRC32: contiguous CPU tensors' bytes copied here
    double out[N_STATS];
};

// The objects a type holds, each type's listed once (ENTRIES_HELD, DISPATCH_HELD): its traverse,
// clear and dealloc go through the list, so a field added to the type is added in one place.
template <class T, size_t N>
int visit_held(PyObject *op, PyObject *T::*const (&held)[N], visitproc visit, void *arg) {
    T *self = reinterpret_cast<T *>(op);
    for (PyObject *T::*field : held) Py_VISIT(self->*field);
    return 0;
}

template <class T, size_t N>
void clear_held(PyObject *op, PyObject *T::*const (&held)[N]) {
    T *self = reinterpret_cast<T *>(op);
    for (PyObject *T::*field : held) Py_CLEAR(self->*field);
}

template <int (*clear)(PyObject *)>
void dealloc_held(PyObject *op) {
    PyObject_GC_UnTrack(op);
    clear(op);
    Py_TYPE(op)->tp_free(op);
}

constexpr PyObject *Entries::*const ENTRIES_HELD[] = {
    &Entries::stopped, &Entries::seen, &Entries::add_row, &Entries::add_finite_row, &Entries::submit,
    &Entries::index_row, &Entries::strided, &Entries::dtype_names, &Entries::kernel_codes, &Entries::no_extra,
    &Entries::tensor_type, &Entries::parameter_type, &Entries::dtype_type, &Entries::param_names,
    &Entries::disable_torch_function, &Entries::copy, &Entries::other_in_python};

// Calls the session's Python method ``slow`` with the six arguments: the leaf this file leaves.
// 0 done, -1 error.
int deferred(Entries *self, PyObject *slow, PyObject *const *args) {
    PyObject *call[7] = {reinterpret_cast<PyObject *>(self), args[0], args[1], args[2], args[3], args[4], args[5]};
    PyObject *done = PyObject_VectorcallMethod(slow, call, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    if (done == nullptr) return -1;
    Py_DECREF(done);
    return 0;
}

PyObject *attr_call(PyObject *obj, PyObject *name) {
    return PyObject_VectorcallMethod(name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// Nothing this file makes can be part of a reference cycle (rows hold strings, numbers, None,
// the shared empty dict and tuples of numbers; the repeat table's tuples hold a weak reference
// without a callback), so each is taken off the garbage collector's list when made. Left on it,
// the ~8,000 objects an API dump makes a step set off a young collection every ~700 of them and
// outlive it into the older generations, whose collections then visit them again: ~3 ms a
// decode step of SmolLM2. (CPython itself untracks such tuples, but only when a collection
// visits them.)
template <class T>
T *untracked(T *obj) {
    if (obj != nullptr) PyObject_GC_UnTrack(obj);
    return obj;
}

// str(n): an entry's key, made for every first capture (PyUnicode_FromFormat parses its format
// through printf's machinery on every call)
PyObject *decimal_string(long long n) {
    char digits[24], *end = digits + sizeof digits, *p = end;
    unsigned long long u = n < 0 ? 0ULL - static_cast<unsigned long long>(n) : static_cast<unsigned long long>(n);
    do {
        *--p = static_cast<char>('0' + u % 10);
        u /= 10;
    } while (u != 0);
    if (n < 0) *--p = '-';
    PyObject *text = PyUnicode_New(end - p, 127);
    if (text != nullptr) std::memcpy(PyUnicode_1BYTE_DATA(text), p, static_cast<size_t>(end - p));
    return text;
}

// The row: a plain tuple in IndexRow's field order, handed to add_finite_row where every float
// it holds is finite (``finite``: the caller's statistics or value checked, as
// llmflow_dump.finite_row does; the writer encodes those rows without looking at each, see
// llmflow_dump.index_line), else to add_row. Steals nothing.
PyObject *emit(Entries *self, PyObject *const *fields, bool finite = true) {
    PyObject *row = untracked(PyTuple_New(15));
    if (row == nullptr) return nullptr;
    for (int i = 0; i < 15; i++) {
        Py_INCREF(fields[i]);
        PyTuple_SET_ITEM(row, i, fields[i]);
    }
    PyObject *done = PyObject_CallOneArg(finite ? self->add_finite_row : self->add_row, row);
    Py_DECREF(row);
    return done;
}

// an IndexRow of the fields, handed to the writer's submit with the tensor's bytes (or, for a
// repeat, alone); steals nothing
PyObject *submit_row(Entries *self, PyObject *const *fields, PyObject *payload, PyObject *event, long long nbytes) {
    PyTypeObject *type = reinterpret_cast<PyTypeObject *>(self->index_row);
    PyObject *row = untracked(type->tp_alloc(type, 15));
    if (row == nullptr) return nullptr;
    for (int i = 0; i < 15; i++) {
        Py_INCREF(fields[i]);
        PyTuple_SET_ITEM(row, i, fields[i]);
    }
    PyObject *done;
    if (payload == nullptr) {
        done = PyObject_CallOneArg(self->submit, row);
    } else {
        PyObject *size = PyLong_FromLongLong(nbytes);
        PyObject *call[4] = {row, payload, event, size};
        done = size ? PyObject_Vectorcall(self->submit, call, 4, nullptr) : nullptr;
        Py_XDECREF(size);
    }
    Py_DECREF(row);
    return done;
}

// The object a weak reference points at, as a new reference (None when it is gone), or null
// with an error set.
PyObject *referent(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj;
    if (PyWeakref_GetRef(ref, &obj) < 0) return nullptr;
    if (obj == nullptr) Py_RETURN_NONE;
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    if (obj == nullptr) return nullptr;
    Py_INCREF(obj);
    return obj;
#endif
}

// A repeat (the same tensor, unchanged, captured already this step): its row, or
// 0 when ``t`` is not one (``*handled`` stays false), -1 on error.
int repeat_row(Entries *self, PyObject *const *args, PyObject *id, PyObject *version, bool *handled) {
    PyObject *seen = PyDict_GetItemWithError(self->seen, id);  // borrowed
    if (seen == nullptr) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(seen) || PyTuple_GET_SIZE(seen) != 6) return 0;
    PyObject *ref = PyTuple_GET_ITEM(seen, 0);
    if (!PyWeakref_CheckRef(ref)) return 0;
    PyObject *obj = referent(ref);
    if (obj == nullptr) return -1;
    bool same = obj == args[3];
    Py_DECREF(obj);
    if (!same) return 0;
    int equal = PyObject_RichCompareBool(PyTuple_GET_ITEM(seen, 1), version, Py_EQ);
    if (equal <= 0) return equal;
    PyObject *has_data = PyTuple_GET_ITEM(seen, 4);
    if (has_data != Py_False && has_data != Py_True) return 0;
    PyObject *step = PyLong_FromLongLong(self->step), *order = PyLong_FromLongLong(self->order);
    if (step == nullptr || order == nullptr) {
        Py_XDECREF(step);
        Py_XDECREF(order);
        return -1;
    }
    self->order++;
    self->entries++;
    PyObject *fields[15] = {step, args[0], args[1], args[2], args[4], order, PyTuple_GET_ITEM(seen, 2),
                            PyTuple_GET_ITEM(seen, 3), args[5], Py_None, has_data, Py_None, Py_None,
                            PyTuple_GET_ITEM(seen, 5), self->no_extra};
    // (with data: the writer resolves the key to the first copy's data file; without: the reader
    // gives it the statistics of the entry with its key)
    PyObject *done = has_data == Py_True ? submit_row(self, fields, nullptr, nullptr, 0) : emit(self, fields);
    Py_DECREF(step);
    Py_DECREF(order);
    if (done == nullptr) return -1;
    Py_DECREF(done);
    *handled = true;
    return 0;
}

// Whether a tensor's first capture takes the fast path: in a statistics dump, a contiguous CPU
// tensor of a kernel dtype (its statistics now); in a tensor dump without CRC32, a contiguous CPU
// tensor whose memory is its values (a plain strided tensor, not a lazy negation or conjugate:
// its bytes copied now). ``meta``: the reader's, or null. 1 yes, 0 no, -1 error.
int fast_path(Entries *self, PyObject *t, PyObject *dtype, long long *code, const TensorMeta *meta) {
    if (self->statistics ? self->kernel == nullptr : !self->data) return 0;
    if (self->statistics) {
        PyObject *code_obj = PyDict_GetItemWithError(self->kernel_codes, dtype);  // borrowed
        if (code_obj == nullptr) return PyErr_Occurred() ? -1 : 0;
        if ((*code = PyLong_AsLongLong(code_obj)) == -1 && PyErr_Occurred()) return -1;
        if (meta != nullptr) return meta->is_cpu && meta->contiguous ? 1 : 0;
    } else if (meta != nullptr) {
        return meta->is_cpu && meta->contiguous && meta->strided && !meta->is_neg && !meta->is_conj ? 1 : 0;
    }
    PyObject *flag = PyObject_GetAttr(t, s_is_cpu);
    if (flag == nullptr) return -1;
    bool yes = flag == Py_True;
    Py_DECREF(flag);
    if (!yes) return 0;
    if ((flag = attr_call(t, s_is_contiguous)) == nullptr) return -1;
    yes = flag == Py_True;
    Py_DECREF(flag);
    if (!yes || self->statistics) return yes ? 1 : 0;
    if ((flag = PyObject_GetAttr(t, s_layout)) == nullptr) return -1;
    yes = flag == self->strided;
    Py_DECREF(flag);
    for (PyObject *lazy : {s_is_neg, s_is_conj}) {
        if (!yes) return 0;
        if ((flag = attr_call(t, lazy)) == nullptr) return -1;
        yes = flag == Py_False;
        Py_DECREF(flag);
    }
    return yes ? 1 : 0;
}

// A tensor's first capture this step, where this file takes it: the fast path above (its
// statistics, or its bytes, now), or else a copy for the writer (``copy``: a CPU view that is not
// contiguous, a tensor on an accelerator, a dtype the kernel lacks), as DumpSession._tensor does.
// Left to that method: CRC32 dumps' copies, a tensor that requires grad, an empty tensor, a dtype
// safetensors cannot store, the entry that would pass max_bytes. 1 done, 0 not this file's leaf
// (nothing changed), -1 error.
int first_capture(Entries *self, PyObject *const *args, PyObject *id, PyObject *version, const TensorMeta *meta) {
    PyObject *t = args[3];
    int result = -1, fast = 0;
    long long numel = 0, code = 0, nbytes = 0, entry_bytes = STATS_ENTRY_BYTES;
    void *data = nullptr;
    PyObject *dtype = nullptr, *dtype_name, *flag = nullptr, *n = nullptr, *ptr = nullptr, *size = nullptr,
             *shape = nullptr, *key = nullptr, *step = nullptr, *order = nullptr, *stats = nullptr,
             *payload = nullptr, *copied = nullptr, *done = nullptr;
    if ((dtype = PyObject_GetAttr(t, s_dtype)) == nullptr) goto out;
    if ((dtype_name = PyDict_GetItemWithError(self->dtype_names, dtype)) == nullptr) {  // borrowed
        result = PyErr_Occurred() ? -1 : 0;  // a dtype safetensors cannot store: the Python path
        goto out;
    }
    if ((fast = fast_path(self, t, dtype, &code, meta)) < 0) goto out;
    if (!fast) {
        if (self->copy == nullptr || self->copy == Py_None) { result = 0; goto out; }
        if (meta != nullptr) {
            if (meta->requires_grad) { result = 0; goto out; }  // (its copy is taken detached: the Python path)
        } else {
            if ((flag = PyObject_GetAttr(t, s_requires_grad)) == nullptr) goto out;
            if (flag != Py_False) { result = 0; goto out; }
        }
    }
    if (meta != nullptr) {
        numel = meta->numel;
    } else {
        if ((n = attr_call(t, s_numel)) == nullptr) goto out;
        numel = PyLong_AsLongLong(n);
        if (numel == -1 && PyErr_Occurred()) goto out;
    }
    if (numel <= 0) { result = 0; goto out; }  // an empty tensor: the Python path
    if (!fast || !self->statistics) {
        if (meta != nullptr) {
            nbytes = meta->nbytes;
        } else {
            Py_CLEAR(n);
            if ((n = PyObject_GetAttr(t, s_nbytes)) == nullptr) goto out;
            nbytes = PyLong_AsLongLong(n);
            if (nbytes == -1 && PyErr_Occurred()) goto out;
        }
        if (!self->statistics) entry_bytes = nbytes;
    }
    if (self->max_bytes >= 0 && self->bytes + entry_bytes > self->max_bytes) { result = 0; goto out; }
    if (fast && meta != nullptr) {
        if ((data = meta->data) == nullptr) { result = 0; goto out; }
    } else if (fast) {
        if ((ptr = attr_call(t, s_data_ptr)) == nullptr) goto out;
        data = PyLong_AsVoidPtr(ptr);
        if (data == nullptr) {
            result = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
    }
    if (meta != nullptr) {
        if ((shape = untracked(PyTuple_New(meta->ndim))) == nullptr) goto out;
        for (int i = 0; i < meta->ndim; i++) {
            PyObject *dim = PyLong_FromLongLong(meta->sizes[i]);
            if (dim == nullptr) goto out;
            PyTuple_SET_ITEM(shape, i, dim);
        }
    } else if ((size = PyObject_GetAttr(t, s_shape)) == nullptr
               || (shape = untracked(PySequence_Tuple(size))) == nullptr) {
        goto out;
    }
    // from here on the entry is this file's: the same steps, in order, as DumpSession._tensor
    if ((step = PyLong_FromLongLong(self->step)) == nullptr || (order = PyLong_FromLongLong(self->order)) == nullptr
        || (key = decimal_string(self->entries + 1)) == nullptr)
        goto out;
    self->order++;
    self->bytes += entry_bytes;
    self->entries++;
    if (self->step >= 0 && version != Py_None && self->record_repeats) {
        PyObject *ref = untracked(PyWeakref_NewRef(t, nullptr));
        if (ref == nullptr) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto out;
            PyErr_Clear();  // a tensor type without weak references: no de-duplication
        } else {
            PyObject *has_data = self->statistics ? Py_False : Py_True;
            PyObject *seen = untracked(PyTuple_Pack(6, ref, version, dtype_name, shape, has_data, key));
            Py_DECREF(ref);
            if (seen == nullptr) goto out;
            int set = PyDict_SetItem(self->seen, id, seen);
            Py_DECREF(seen);
            if (set < 0) goto out;
        }
    }
    if (fast && self->statistics) {
        if ((stats = untracked(PyTuple_New(N_STATS))) == nullptr) goto out;
        self->kernel(data, static_cast<int>(code), numel, self->out);
        for (int i = 0; i < N_STATS; i++) {
            PyObject *v = PyFloat_FromDouble(self->out[i]);
            if (v == nullptr) goto out;
            PyTuple_SET_ITEM(stats, i, v);
        }
        PyObject *fields[15] = {step, args[0], args[1], args[2], args[4], order, dtype_name, shape, args[5],
                                stats, Py_False, Py_None, Py_None, key, self->no_extra};
        // (llmflow_dump.finite_row's test of statistics: max + min + mean + norm is finite)
        const double *o = self->out;
        if ((done = emit(self, fields, std::isfinite(o[0] + o[1] + o[2] + o[3]))) == nullptr) goto out;
    } else {
        PyObject *event = Py_None;
        if (fast) {
            if ((payload = PyBytes_FromStringAndSize(static_cast<const char *>(data), nbytes)) == nullptr) goto out;
        } else {  // (payload, event): a copy on the tensor's device, or on the host, and what to wait on
            if ((copied = PyObject_CallOneArg(self->copy, t)) == nullptr) goto out;
            if (!PyTuple_CheckExact(copied) || PyTuple_GET_SIZE(copied) != 2) {
                PyErr_SetString(PyExc_TypeError, "the capture's copy must return (payload, event)");
                goto out;
            }
            payload = Py_NewRef(PyTuple_GET_ITEM(copied, 0));
            event = PyTuple_GET_ITEM(copied, 1);
        }
        PyObject *has_data = self->statistics ? Py_False : Py_True;
        PyObject *fields[15] = {step, args[0], args[1], args[2], args[4], order, dtype_name, shape, args[5],
                                Py_None, has_data, Py_None, Py_None, key, self->no_extra};
        if ((done = submit_row(self, fields, payload, event, nbytes)) == nullptr) goto out;
    }
    result = 1;
out:
    Py_XDECREF(dtype);
    Py_XDECREF(flag);
    Py_XDECREF(n);
    Py_XDECREF(ptr);
    Py_XDECREF(size);
    Py_XDECREF(shape);
    Py_XDECREF(key);
    Py_XDECREF(step);
    Py_XDECREF(order);
    Py_XDECREF(stats);
    Py_XDECREF(payload);
    Py_XDECREF(copied);
    Py_XDECREF(done);
    return result;
}

// The walk's tensor leaf: args = name, kind, index, t, level, module_type. 0 done, -1 error.
int tensor_leaf(Entries *self, PyObject *const *args) {
    if (self->stopped != nullptr && self->stopped != Py_None) return 0;
    PyObject *t = args[3];
    if (Py_TYPE(t) != reinterpret_cast<PyTypeObject *>(self->tensor_type) || self->seen == nullptr)
        return deferred(self, s_tensor_slow, args);
    TensorMeta read;
    const TensorMeta *meta = self->meta_reader != nullptr && self->meta_reader(t, &read) == 1 ? &read : nullptr;
    PyObject *version = meta != nullptr ? PyLong_FromLongLong(meta->version) : PyObject_GetAttr(t, s_version);
    if (version == nullptr) {  // an inference tensor has no version counter: the Python path
        if (meta != nullptr || !PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1;
        PyErr_Clear();
        return deferred(self, s_tensor_slow, args);
    }
    PyObject *id = PyLong_FromVoidPtr(t);
    if (id == nullptr) {
        Py_DECREF(version);
        return -1;
    }
    bool handled = false;
    int done = repeat_row(self, args, id, version, &handled);
    if (done == 0 && !handled) {
        done = first_capture(self, args, id, version, meta);
        handled = done == 1;
    }
    Py_DECREF(id);
    Py_DECREF(version);
    if (done < 0) return -1;
    return handled ? 0 : deferred(self, s_tensor_slow, args);
}

// A Parameter handed to a call: its shape, dtype and name (DumpSession._other's rows).
int parameter_row(Entries *self, PyObject *const *args, bool *handled) {
    PyObject *value = args[3], *dtype = nullptr, *size = nullptr, *shape = nullptr, *extra = nullptr,
             *id = nullptr, *step = nullptr, *order = nullptr, *done = nullptr, *dtype_name, *param;
    int result = -1;
    if ((dtype = PyObject_GetAttr(value, s_dtype)) == nullptr) goto out;
    if ((dtype_name = PyDict_GetItemWithError(self->dtype_names, dtype)) == nullptr) {
        result = PyErr_Occurred() ? -1 : 0;  // a dtype the table lacks: the Python path names it
        goto out;
    }
    if ((size = PyObject_GetAttr(value, s_shape)) == nullptr || (shape = untracked(PySequence_Tuple(size))) == nullptr
        || (id = PyLong_FromVoidPtr(value)) == nullptr || (extra = PyDict_New()) == nullptr
        || PyDict_SetItem(extra, s_param_dtype, dtype_name) < 0)
        goto out;
    if ((param = PyDict_GetItemWithError(self->param_names, id)) != nullptr) {
        if (PyDict_SetItem(extra, s_param, param) < 0) goto out;
    } else if (PyErr_Occurred()) {
        goto out;
    }
    if ((step = PyLong_FromLongLong(self->step)) == nullptr || (order = PyLong_FromLongLong(self->order)) == nullptr)
        goto out;
    self->order++;
    self->entries++;
    {
        PyObject *fields[15] = {step, args[0], args[1], args[2], args[4], order, Py_None, shape, args[5],
                                Py_None, Py_False, Py_None, s_parameter, s_empty, extra};
        if ((done = emit(self, fields)) == nullptr) goto out;
    }
    *handled = true;
    result = 0;
out:
    Py_XDECREF(dtype);
    Py_XDECREF(size);
    Py_XDECREF(shape);
    Py_XDECREF(extra);
    Py_XDECREF(id);
    Py_XDECREF(step);
    Py_XDECREF(order);
    Py_XDECREF(done);
    return result;
}

// The walk's other leaf: None, a bool, int or float as its value; a torch dtype by its name
// ("torch.float32"); a Parameter by shape, dtype and name. 0 done, -1 error.
int other_leaf(Entries *self, PyObject *const *args) {
    if (self->stopped != nullptr && self->stopped != Py_None) return 0;
    PyObject *value = args[3], *pytype, *stored = value, *named = nullptr;
    if (value == Py_None) pytype = pytype_none;
    else if (PyBool_Check(value)) pytype = pytype_bool;
    else if (PyLong_CheckExact(value)) pytype = pytype_int;
    else if (PyFloat_CheckExact(value)) pytype = pytype_float;
    else if (Py_TYPE(value) == reinterpret_cast<PyTypeObject *>(self->parameter_type)) {
        bool handled = false;
        if (parameter_row(self, args, &handled) < 0) return -1;
        return handled ? 0 : deferred(self, s_other_slow, args);
    } else if (Py_TYPE(value) == reinterpret_cast<PyTypeObject *>(self->dtype_type)) {
        pytype = pytype_dtype;
        if ((named = PyObject_Str(value)) == nullptr) return -1;
        if (PyUnicode_GET_LENGTH(named) >= 256) {  // (never: the Python path's rule, kept exactly)
            Py_DECREF(named);
            return deferred(self, s_other_slow, args);
        }
        stored = named;
    } else if (PyUnicode_CheckExact(value)) {  // (the Python path keeps strings shorter than 256)
        pytype = pytype_str;
        if (PyUnicode_GET_LENGTH(value) >= 256) stored = Py_None;
    } else {  // any other value is written as its type's name, save those only _other writes
        int in_python = PyObject_IsInstance(value, self->other_in_python);
        if (in_python != 0) return in_python < 0 ? -1 : deferred(self, s_other_slow, args);
        if ((named = PyObject_GetAttr(reinterpret_cast<PyObject *>(Py_TYPE(value)), s_name)) == nullptr) return -1;
        pytype = named;
        stored = Py_None;
    }
    PyObject *step = PyLong_FromLongLong(self->step), *order = PyLong_FromLongLong(self->order);
    PyObject *done = nullptr;
    if (step != nullptr && order != nullptr) {
        self->order++;
        self->entries++;
        PyObject *fields[15] = {step, args[0], args[1], args[2], args[4], order, Py_None, Py_None, args[5],
                                Py_None, Py_False, stored, pytype, s_empty, self->no_extra};
        done = emit(self, fields, pytype != pytype_float || std::isfinite(PyFloat_AS_DOUBLE(value)));
    }
    Py_XDECREF(named);
    Py_XDECREF(step);
    Py_XDECREF(order);
    if (done == nullptr) return -1;
    Py_DECREF(done);
    return 0;
}

PyObject *leaf_method(PyObject *op, PyObject *const *args, Py_ssize_t nargs, int (*leaf)(Entries *, PyObject *const *)) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "a leaf takes name, kind, index, value, level, module_type");
        return nullptr;
    }
    if (leaf(reinterpret_cast<Entries *>(op), args) < 0) return nullptr;
    Py_RETURN_NONE;
}

PyObject *Entries_tensor(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    return leaf_method(op, args, nargs, tensor_leaf);
}

PyObject *Entries_other(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    return leaf_method(op, args, nargs, other_leaf);
}

// -- the walk over a call's values: recorder.py's walk_inputs / walk_output / _walk, label for
// label, its leaves the two above -------------------------------------------------------------
constexpr int MAX_DEPTH = 6;  // recorder.MAX_DEPTH
constexpr int N_POSITIONAL = 32;
PyObject *positional[N_POSITIONAL];  // "0" .. "31"
PyObject *keyword_labels;            // keyword -> "kw:<keyword>"

PyObject *child_labels;              // label -> [label.0, label.1, ...]

PyObject *position_label(Py_ssize_t i) {
    if (i < N_POSITIONAL) {
        Py_INCREF(positional[i]);
        return positional[i];
    }
    return decimal_string(i);
}

// f"{prefix}.{i}" as a new reference, made once: ``table`` keeps prefix -> [prefix.0, prefix.1,
// ...] (every decode step names the same nested values and the same ops)
PyObject *numbered(PyObject *table, PyObject *prefix, Py_ssize_t i) {
    PyObject *made = PyDict_GetItemWithError(table, prefix);
    if (made == nullptr) {
        if (PyErr_Occurred() || (made = PyList_New(0)) == nullptr) return nullptr;
        int failed = PyDict_SetItem(table, prefix, made);
        Py_DECREF(made);  // (the table holds it)
        if (failed < 0) return nullptr;
    }
    while (PyList_GET_SIZE(made) <= i) {
        PyObject *next = PyUnicode_FromFormat("%U.%zd", prefix, PyList_GET_SIZE(made));
        int failed = next == nullptr ? -1 : PyList_Append(made, next);
        Py_XDECREF(next);
        if (failed < 0) return nullptr;
    }
    PyObject *text = PyList_GET_ITEM(made, i);
    Py_INCREF(text);
    return text;
}

// f"{index}.{i}": kept for the first N_POSITIONAL of a sequence (a layer's rotary embeddings, a
// tuple output get the same labels every call)
PyObject *child_label(PyObject *index, Py_ssize_t i) {
    return i < N_POSITIONAL ? numbered(child_labels, index, i) : PyUnicode_FromFormat("%U.%zd", index, i);
}

// A mapping's items as a sequence of pairs (a dict's own; anything else through its items()).
PyObject *items_of(PyObject *mapping) {
    PyObject *items = PyDict_CheckExact(mapping) ? PyDict_Items(mapping) : PyObject_CallMethod(mapping, "items", nullptr);
    if (items == nullptr) return nullptr;
    PyObject *seq = PySequence_Fast(items, "a mapping's items");
    Py_DECREF(items);
    return seq;
}

struct Walk {
    Entries *self;
    PyObject *name, *kind, *level, *module_type;
    bool tensors_only;

    int leaf(int (*fn)(Entries *, PyObject *const *), PyObject *index, PyObject *value) {
        PyObject *args[6] = {name, kind, index, value, level, module_type};
        return fn(self, args);
    }

    int children(PyObject *index, PyObject *value, int depth, bool mapping) {
        PyObject *seq = mapping ? items_of(value) : PySequence_Fast(value, "a walked sequence");
        if (seq == nullptr) return -1;
        int result = 0;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < n && result == 0; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *child = item, *label;
            if (mapping) {
                PyObject *pair = PySequence_Fast(item, "an item");
                if (pair == nullptr || PySequence_Fast_GET_SIZE(pair) != 2) {
                    Py_XDECREF(pair);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a mapping item is not a pair");
                    result = -1;
                    break;
                }
                // f"{index}.{key}": the key as format() gives it
                PyObject *text = PyObject_Format(PySequence_Fast_GET_ITEM(pair, 0), s_empty);
                label = text ? PyUnicode_FromFormat("%U.%U", index, text) : nullptr;
                Py_XDECREF(text);
                child = PySequence_Fast_GET_ITEM(pair, 1);
                Py_INCREF(child);
                Py_DECREF(pair);
            } else {
                label = child_label(index, i);
                Py_INCREF(child);
            }
            result = label ? value_at(label, child, depth + 1) : -1;
            Py_XDECREF(label);
            Py_DECREF(child);
        }
        Py_DECREF(seq);
        return result;
    }

    // recorder._walk
    int value_at(PyObject *index, PyObject *value, int depth) {
        PyTypeObject *type = Py_TYPE(value);
        if (type == reinterpret_cast<PyTypeObject *>(self->tensor_type)) return leaf(tensor_leaf, index, value);
        if (type == reinterpret_cast<PyTypeObject *>(self->parameter_type)) return leaf(other_leaf, index, value);
        int is = PyObject_IsInstance(value, self->tensor_type);
        if (is < 0) return -1;
        if (is) {
            int param = PyObject_IsInstance(value, self->parameter_type);
            if (param < 0) return -1;
            return leaf(param ? other_leaf : tensor_leaf, index, value);
        }
        if ((PyTuple_Check(value) || PyList_Check(value)) && depth < MAX_DEPTH) {
            if (Py_SIZE(value) == 0)  // an empty sequence is a leaf of its own (_other writes it)
                return tensors_only ? 0 : leaf(other_leaf, index, value);
            return children(index, value, depth, false);
        }
        if (PyDict_Check(value) && depth < MAX_DEPTH) return children(index, value, depth, true);
        return tensors_only ? 0 : leaf(other_leaf, index, value);
    }

    // recorder.walk_inputs
    int inputs(PyObject *args, PyObject *kwargs) {
        if (!PyTuple_Check(args)) {
            PyErr_SetString(PyExc_TypeError, "a call's positional inputs are a tuple");
            return -1;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
            PyObject *label = position_label(i);
            if (label == nullptr) return -1;
            int done = value_at(label, PyTuple_GET_ITEM(args, i), 0);
            Py_DECREF(label);
            if (done < 0) return -1;
        }
        if (kwargs == Py_None || (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0)) return 0;
        PyObject *seq = items_of(kwargs);
        if (seq == nullptr) return -1;
        int result = 0;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && result == 0; i++) {
            PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                PyErr_SetString(PyExc_TypeError, "a keyword item is not a pair");
                result = -1;
                break;
            }
            PyObject *key = PyTuple_GET_ITEM(pair, 0);
            PyObject *label = PyDict_GetItemWithError(keyword_labels, key);  // borrowed
            if (label == nullptr) {
                if (PyErr_Occurred() || (label = PyUnicode_FromFormat("kw:%S", key)) == nullptr) {
                    result = -1;
                    break;
                }
                int set = PyDict_SetItem(keyword_labels, key, label);
                Py_DECREF(label);  // (the table holds it)
                if (set < 0) {
                    result = -1;
                    break;
                }
            }
            Py_INCREF(label);
            result = value_at(label, PyTuple_GET_ITEM(pair, 1), 0);
            Py_DECREF(label);
        }
        Py_DECREF(seq);
        return result;
    }

    // recorder.walk_output
    int output(PyObject *value) {
        if (Py_TYPE(value) == reinterpret_cast<PyTypeObject *>(self->tensor_type))
            return leaf(tensor_leaf, positional[0], value);
        if (PyTuple_Check(value) || PyList_Check(value)) {
            PyObject *seq = PySequence_Fast(value, "an output sequence");
            if (seq == nullptr) return -1;
            int result = 0;
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && result == 0; i++) {
                PyObject *label = position_label(i), *item = PySequence_Fast_GET_ITEM(seq, i);
                if (label == nullptr) {
                    result = -1;
                    break;
                }
                Py_INCREF(item);
                result = value_at(label, item, 0);
                Py_DECREF(item);
                Py_DECREF(label);
            }
            Py_DECREF(seq);
            return result;
        }
        if (PyDict_Check(value)) {
            PyObject *seq = items_of(value);
            if (seq == nullptr) return -1;
            int result = 0;
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && result == 0; i++) {
                PyObject *pair = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), "an item");
                if (pair == nullptr || PySequence_Fast_GET_SIZE(pair) != 2) {
                    Py_XDECREF(pair);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an output item is not a pair");
                    result = -1;
                    break;
                }
                PyObject *label = PyObject_Str(PySequence_Fast_GET_ITEM(pair, 0));
                result = label ? value_at(label, PySequence_Fast_GET_ITEM(pair, 1), 0) : -1;
                Py_XDECREF(label);
                Py_DECREF(pair);
            }
            Py_DECREF(seq);
            return result;
        }
        return value_at(positional[0], value, 0);
    }
};

// Runs ``walk`` with torch functions off (torch._C.DisableTorchFunction), as recorder.py's walks
// do, so that nothing the leaves read or compute is itself recorded.
template <class F>
PyObject *without_torch_functions(Entries *self, F walk) {
    PyObject *guard = PyObject_CallNoArgs(self->disable_torch_function);
    if (guard == nullptr) return nullptr;
    PyObject *entered = attr_call(guard, s_enter);
    if (entered == nullptr) {
        Py_DECREF(guard);
        return nullptr;
    }
    Py_DECREF(entered);
    int done = walk();
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *exit_args[4] = {guard, Py_None, Py_None, Py_None};
    PyObject *exited = PyObject_VectorcallMethod(s_exit, exit_args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    Py_DECREF(guard);
    if (exited == nullptr) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(trace);
        return nullptr;
    }
    Py_DECREF(exited);
    PyErr_Restore(type, value, trace);
    if (done < 0) return nullptr;
    Py_RETURN_NONE;
}

bool wrong_count(Py_ssize_t nargs, Py_ssize_t want, const char *what) {
    if (nargs == want) return false;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", what, want, nargs);
    return true;
}

// the recorder's sink methods (DumpSession's, see capture.py)
PyObject *Entries_module_inputs(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {  // name, mtype, module, args, kwargs
    if (wrong_count(nargs, 5, "module_inputs")) return nullptr;
    Entries *self = reinterpret_cast<Entries *>(op);
    Walk w{self, a[0], s_input, s_module, a[1], false};
    return without_torch_functions(self, [&] { return w.inputs(a[3], a[4]); });
}

PyObject *Entries_module_output(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {  // ..., output
    if (wrong_count(nargs, 6, "module_output")) return nullptr;
    Entries *self = reinterpret_cast<Entries *>(op);
    Walk w{self, a[0], s_output, s_module, a[1], false};
    return without_torch_functions(self, [&] { return w.output(a[5]); });
}

PyObject *Entries_op_inputs(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {  // name, api, func, args, kwargs
    if (wrong_count(nargs, 5, "op_inputs")) return nullptr;
    Entries *self = reinterpret_cast<Entries *>(op);
    if (!self->op_inputs) Py_RETURN_NONE;
    Walk w{self, a[0], s_input, s_api, a[1], false};
    return without_torch_functions(self, [&] { return w.inputs(a[3], a[4]); });
}

PyObject *Entries_op_output(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {  // name, api, func, output
    if (wrong_count(nargs, 4, "op_output")) return nullptr;
    Entries *self = reinterpret_cast<Entries *>(op);
    if (!self->op_outputs) Py_RETURN_NONE;
    Walk w{self, a[0], s_output, s_api, a[1], true};
    return without_torch_functions(self, [&] { return w.output(a[3]); });
}

// -- API mode's dispatch: api.py's ApiMode.__torch_function__ ----------------------------------
// ApiMode derives from this type too (with torch's TorchFunctionMode): every torch call made while
// the mode is entered comes here, ~2,000 a decode step of SmolLM2, most of them recorded.
PyObject *s_recorder_sink, *s_recorder_stack, *s_recorder_prefix, *s_op_counts, *s_active, *s_wants_op,
    *s_exec_order, *s_op_inputs, *s_op_outputs;

struct Dispatch {
    PyObject_HEAD
    PyObject *recorder;    // the recorder: sink, stack, prefix, op_counts
    PyObject *names;       // callable -> recorded name (None: passed through)
    PyObject *api_name;    // api.api_name
    PyObject *keys;        // module -> {api -> "<module>/<api>"}
    PyObject *full_names;  // "<module>/<api>" -> ["<module>/<api>.0", "<module>/<api>.1", ...]
    PyObject *wanted;      // module -> the sink's wants_op(module), for the sink wanted_sink names
    PyObject *wanted_sink;  // a weak reference to that sink, or None
};

// sink.wants_op(module), asked once per module for a sink's life (api.OpSink): a Python call
// on every recorded op was ~3% of an API dump's work. A sink without weak references is asked
// every time. 1 yes, 0 no, -1 error.
int wants_op(Dispatch *self, PyObject *sink, PyObject *module) {
    bool cached = self->wanted != nullptr;
    PyObject *current = self->wanted_sink != nullptr && PyWeakref_CheckRef(self->wanted_sink)
                            ? referent(self->wanted_sink) : Py_NewRef(Py_None);
    if (current == nullptr) return -1;
    Py_DECREF(current);  // (only its identity is compared)
    if (cached && current != sink) {
        PyObject *ref = PyWeakref_NewRef(sink, nullptr);
        if (ref == nullptr) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
            PyErr_Clear();
            cached = false;
        } else {
            Py_SETREF(self->wanted_sink, ref);
            PyDict_Clear(self->wanted);
        }
    }
    if (cached) {
        PyObject *known = PyDict_GetItemWithError(self->wanted, module);  // borrowed
        if (known != nullptr) return known == Py_True;
        if (PyErr_Occurred()) return -1;
    }
    PyObject *call[2] = {sink, module};
    PyObject *answer = PyObject_VectorcallMethod(s_wants_op, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    if (answer == nullptr) return -1;
    int flag = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    if (flag < 0 || !cached) return flag;
    return PyDict_SetItem(self->wanted, module, flag ? Py_True : Py_False) < 0 ? -1 : flag;
}

// The op's key, made once and kept (and its n-th full name, through ``numbered``): every decode
// step calls the same ops in the same modules, and formatting the two strings (and hashing the
// new key) on every call was ~1% of an API dump. A borrowed reference (the table's), or null.
PyObject *op_key(Dispatch *self, PyObject *module, PyObject *name) {
    PyObject *by_api = PyDict_GetItemWithError(self->keys, module);
    if (by_api == nullptr) {
        if (PyErr_Occurred() || (by_api = PyDict_New()) == nullptr) return nullptr;
        int failed = PyDict_SetItem(self->keys, module, by_api);
        Py_DECREF(by_api);  // (the table holds it)
        if (failed < 0) return nullptr;
    }
    PyObject *key = PyDict_GetItemWithError(by_api, name);
    if (key != nullptr || PyErr_Occurred()) return key;
    if ((key = PyUnicode_FromFormat("%U/%U", module, name)) == nullptr) return nullptr;
    int failed = PyDict_SetItem(by_api, name, key);
    Py_DECREF(key);
    return failed < 0 ? nullptr : key;
}

PyObject *call_func(PyObject *func, PyObject *args, PyObject *kwargs) {
    return PyObject_Call(func, args, kwargs != nullptr && kwargs != Py_None ? kwargs : nullptr);
}

// the recorded name of func: from the table, else api_name(func) (kept when func is hashable)
PyObject *op_name(Dispatch *self, PyObject *func) {
    PyObject *name = PyDict_GetItemWithError(self->names, func);
    if (name != nullptr) {
        Py_INCREF(name);
        return name;
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return nullptr;
        PyErr_Clear();  // an unhashable callable: named every time
        return PyObject_CallOneArg(self->api_name, func);
    }
    name = PyObject_CallOneArg(self->api_name, func);
    if (name != nullptr && PyDict_SetItem(self->names, func, name) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            Py_DECREF(name);
            return nullptr;
        }
        PyErr_Clear();
    }
    return name;
}

// __torch_function__(func, types, args=(), kwargs=None)
PyObject *Dispatch_torch_function(PyObject *op, PyObject *const *a, Py_ssize_t nargs, PyObject *kwnames) {
    Dispatch *self = reinterpret_cast<Dispatch *>(op);
    nargs = PyVectorcall_NARGS(nargs);
    PyObject *by_name[2] = {nullptr, nullptr};  // args=, kwargs= (torch passes all four by position)
    for (Py_ssize_t i = 0; kwnames != nullptr && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *keyword = PyTuple_GET_ITEM(kwnames, i);
        int which = PyUnicode_CompareWithASCIIString(keyword, "args") == 0 ? 0
                    : PyUnicode_CompareWithASCIIString(keyword, "kwargs") == 0 ? 1 : -1;
        if (which < 0 || nargs > 2 + which) {
            PyErr_Format(PyExc_TypeError, "__torch_function__() got an unexpected or repeated argument %R", keyword);
            return nullptr;
        }
        by_name[which] = a[nargs + i];
    }
    if (nargs < 2 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "__torch_function__(func, types, args=(), kwargs=None)");
        return nullptr;
    }
    PyObject *func = a[0], *args = nargs > 2 ? a[2] : by_name[0], *kwargs = nargs > 3 ? a[3] : by_name[1];
    PyObject *empty = nullptr;
    if (args == nullptr || !PyTuple_Check(args)) {
        if (args != nullptr && args != Py_None) {
            args = PySequence_Tuple(args);
            if (args == nullptr) return nullptr;
            empty = args;  // (ours to release)
        } else {
            args = empty = PyTuple_New(0);
            if (args == nullptr) return nullptr;
        }
    }
    PyObject *result = nullptr, *name = nullptr, *sink = nullptr, *stack = nullptr, *module = nullptr,
             *key = nullptr, *counts = nullptr, *count = nullptr, *full = nullptr,
             *order = nullptr, *own_kwargs = nullptr, *done = nullptr;
    long long n = 0;
    int flag;
    if (kwargs == nullptr || kwargs == Py_None) kwargs = own_kwargs = PyDict_New();  // (kwargs or {})
    if (kwargs == nullptr) goto out;
    if ((name = op_name(self, func)) == nullptr) goto out;
    if ((sink = PyObject_GetAttr(self->recorder, s_recorder_sink)) == nullptr) goto out;
    if (name == Py_None || sink == Py_None) goto pass_through;
    {
        PyObject *active = PyObject_GetAttr(sink, s_active);
        if (active == nullptr) goto out;
        flag = PyObject_IsTrue(active);
        Py_DECREF(active);
        if (flag < 0) goto out;
        if (!flag) goto pass_through;
    }
    if ((stack = PyObject_GetAttr(self->recorder, s_recorder_stack)) == nullptr) goto out;
    if (!PyList_Check(stack)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's stack is a list (api.OpNamer)");
        goto out;
    }
    if (PyList_GET_SIZE(stack) > 0) {  // the innermost running module, else the recorder's prefix
        module = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1);
        Py_INCREF(module);
    } else {
        module = PyObject_GetAttr(self->recorder, s_recorder_prefix);
    }
    if (module == nullptr) goto out;
    if ((flag = wants_op(self, sink, module)) < 0) goto out;
    if (!flag) goto pass_through;
    if (!PyUnicode_Check(module) || !PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "module and op names are str");
        goto out;
    }
    if ((key = op_key(self, module, name)) == nullptr) goto out;
    Py_INCREF(key);
    if ((counts = PyObject_GetAttr(self->recorder, s_op_counts)) == nullptr) goto out;
    if ((count = PyDict_GetItemWithError(counts, key)) != nullptr) {
        n = PyLong_AsLongLong(count);
        if (n == -1 && PyErr_Occurred()) goto out;
    } else if (PyErr_Occurred()) {
        goto out;
    }
    count = nullptr;
    if ((count = PyLong_FromLongLong(n + 1)) == nullptr || PyDict_SetItem(counts, key, count) < 0) goto out;
    if (n < 0) {  // (a count the table was not meant to hold: named as the Python path names it)
        if ((full = PyUnicode_FromFormat("%U.%lld", key, n)) == nullptr) goto out;
    } else if ((full = numbered(self->full_names, key, static_cast<Py_ssize_t>(n))) == nullptr) {
        goto out;
    }
    if ((order = PyObject_GetAttr(sink, s_exec_order)) == nullptr) goto out;
    if (order != Py_None) {
        if (PyList_CheckExact(order) ? PyList_Append(order, full) < 0
                                     : (done = PyObject_CallMethod(order, "append", "O", full)) == nullptr)
            goto out;
        Py_CLEAR(done);
    }
    {
        PyObject *call[6] = {sink, full, name, func, args, kwargs};
        if ((done = PyObject_VectorcallMethod(s_op_inputs, call, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr)) == nullptr)
            goto out;
        Py_CLEAR(done);
    }
    if ((result = call_func(func, args, kwargs)) == nullptr) goto out;
    {
        PyObject *call[5] = {sink, full, name, func, result};
        if ((done = PyObject_VectorcallMethod(s_op_outputs, call, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr)) == nullptr)
            Py_CLEAR(result);
    }
    goto out;
pass_through:
    result = call_func(func, args, kwargs);
out:
    Py_XDECREF(empty);
    Py_XDECREF(own_kwargs);
    Py_XDECREF(name);
    Py_XDECREF(sink);
    Py_XDECREF(stack);
    Py_XDECREF(module);
    Py_XDECREF(key);
    Py_XDECREF(counts);
    Py_XDECREF(count);
    Py_XDECREF(full);
    Py_XDECREF(order);
    Py_XDECREF(done);
    return result;
}

// _setup_dispatch(recorder, names, api_name)
PyObject *Dispatch_setup(PyObject *op, PyObject *const *a, Py_ssize_t nargs) {
    Dispatch *self = reinterpret_cast<Dispatch *>(op);
    if (wrong_count(nargs, 3, "_setup_dispatch")) return nullptr;
    if (!PyDict_CheckExact(a[1])) {
        PyErr_SetString(PyExc_TypeError, "_setup_dispatch(): names is a dict");
        return nullptr;
    }
    PyObject **slots[3] = {&self->recorder, &self->names, &self->api_name};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(a[i]);
        Py_XSETREF(*slots[i], a[i]);
    }
    Py_XSETREF(self->keys, PyDict_New());
    Py_XSETREF(self->full_names, PyDict_New());
    Py_XSETREF(self->wanted, PyDict_New());
    Py_XSETREF(self->wanted_sink, Py_NewRef(Py_None));
    if (self->keys == nullptr || self->full_names == nullptr || self->wanted == nullptr) return nullptr;
    Py_RETURN_NONE;
}

constexpr PyObject *Dispatch::*const DISPATCH_HELD[] = {&Dispatch::recorder, &Dispatch::names, &Dispatch::api_name,
                                                        &Dispatch::keys, &Dispatch::full_names, &Dispatch::wanted,
                                                        &Dispatch::wanted_sink};

int Dispatch_traverse(PyObject *op, visitproc visit, void *arg) { return visit_held(op, DISPATCH_HELD, visit, arg); }

int Dispatch_clear(PyObject *op) {
    clear_held(op, DISPATCH_HELD);
    return 0;
}

PyMethodDef Dispatch_methods[] = {
    {"__torch_function__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Dispatch_torch_function)),
     METH_FASTCALL | METH_KEYWORDS, "api.py's ApiMode.__torch_function__, in C."},
    {"_setup_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Dispatch_setup)), METH_FASTCALL,
     "What the dispatch reads, set once by the mode."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject DispatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// _setup_entries(seen, add_row, submit, dtype_names, kernel_codes, no_extra, tensor_type,
//                parameter_type, dtype_type, index_row, strided, param_names,
//                disable_torch_function, copy, kernel_address, max_bytes, record_repeats,
//                statistics, data, op_inputs, op_outputs, meta_address, other_in_python,
//                add_finite_row): what the capture reads, set once by the session
PyObject *Entries_setup(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    Entries *self = reinterpret_cast<Entries *>(op);
    if (wrong_count(nargs, 24, "_setup_entries")) return nullptr;
    if (!PyDict_Check(args[0]) || !PyDict_CheckExact(args[3]) || !PyDict_CheckExact(args[4])
        || !PyDict_CheckExact(args[5]) || !PyType_Check(args[6]) || !PyType_Check(args[7]) || !PyType_Check(args[8])
        || !PyType_Check(args[9]) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(args[9]), &PyTuple_Type)
        || !PyDict_CheckExact(args[11]) || !PyTuple_Check(args[22])) {
        PyErr_SetString(PyExc_TypeError, "_setup_entries(): seen, dtype_names, kernel_codes, no_extra and "
                                         "param_names are dicts; tensor_type, parameter_type, dtype_type types; "
                                         "index_row a tuple type; other_in_python a tuple");
        return nullptr;
    }
    if (args[13] != Py_None && !PyCallable_Check(args[13])) {
        PyErr_SetString(PyExc_TypeError, "_setup_entries(): copy is a callable or None");
        return nullptr;
    }
    long long address = PyLong_AsLongLong(args[14]), max_bytes = PyLong_AsLongLong(args[15]),
              meta_address = PyLong_AsLongLong(args[21]);
    if (PyErr_Occurred()) return nullptr;
    PyObject **slots[16] = {&self->seen, &self->add_row, &self->submit, &self->dtype_names, &self->kernel_codes,
                            &self->no_extra, &self->tensor_type, &self->parameter_type, &self->dtype_type,
                            &self->index_row, &self->strided, &self->param_names, &self->disable_torch_function,
                            &self->copy, &self->other_in_python, &self->add_finite_row};
    const int given[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 22, 23};
    for (int i = 0; i < 16; i++) {
        Py_INCREF(args[given[i]]);
        Py_XSETREF(*slots[i], args[given[i]]);
    }
    self->kernel = reinterpret_cast<StatsKernel>(static_cast<intptr_t>(address));
    self->meta_reader = reinterpret_cast<MetaReader>(static_cast<intptr_t>(meta_address));
    self->max_bytes = max_bytes;
    self->record_repeats = PyObject_IsTrue(args[16]) == 1 && PyDict_CheckExact(args[0]);
    self->statistics = PyObject_IsTrue(args[17]) == 1;
    self->data = PyObject_IsTrue(args[18]) == 1;
    self->op_inputs = PyObject_IsTrue(args[19]) == 1;
    self->op_outputs = PyObject_IsTrue(args[20]) == 1;
    Py_RETURN_NONE;
}

int Entries_traverse(PyObject *op, visitproc visit, void *arg) { return visit_held(op, ENTRIES_HELD, visit, arg); }

int Entries_clear(PyObject *op) {
    clear_held(op, ENTRIES_HELD);
    reinterpret_cast<Entries *>(op)->kernel = nullptr;
    reinterpret_cast<Entries *>(op)->meta_reader = nullptr;
    return 0;
}

PyObject *Entries_new(PyTypeObject *type, PyObject *, PyObject *) {
    Entries *self = reinterpret_cast<Entries *>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    self->step = -1;
    self->max_bytes = -1;
    Py_INCREF(Py_None);
    self->stopped = Py_None;
    return reinterpret_cast<PyObject *>(self);
}

PyMethodDef Entries_methods[] = {
    {"tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_tensor)), METH_FASTCALL,
     "The walk's tensor leaf (see the file's comment)."},
    {"other", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_other)), METH_FASTCALL,
     "The walk's other leaf (see the file's comment)."},
    {"module_inputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_module_inputs)),
     METH_FASTCALL, "The recorder's sink: a module's inputs, walked."},
    {"module_output", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_module_output)),
     METH_FASTCALL, "The recorder's sink: a module's output, walked."},
    {"op_inputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_op_inputs)), METH_FASTCALL,
     "The recorder's sink: an op's inputs, walked."},
    {"op_output", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_op_output)), METH_FASTCALL,
     "The recorder's sink: an op's output, walked (tensors only)."},
    {"_setup_entries", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Entries_setup)),
     METH_FASTCALL, "What the fast path reads, set once by the session."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef Entries_members[] = {
    {const_cast<char *>("step"), T_LONGLONG, offsetof(Entries, step), 0, nullptr},
    {const_cast<char *>("order"), T_LONGLONG, offsetof(Entries, order), 0, nullptr},
    {const_cast<char *>("entries"), T_LONGLONG, offsetof(Entries, entries), 0, nullptr},
    {const_cast<char *>("bytes"), T_LONGLONG, offsetof(Entries, bytes), 0, nullptr},
    {const_cast<char *>("stopped"), T_OBJECT, offsetof(Entries, stopped), 0, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject EntriesType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -- the recorder's wrapper around a module's forward: recorder.py's recording_forward ---------
// Every call of every instrumented module comes through here (~360 a decode step of SmolLM2),
// and the Python closure's frame, its *args/**kwargs packing and its attribute reads cost 0.5-1.4
// us a call more (a statistics dump of a toy model, the two alternated). Same steps, same order: the
// sink read from the recorder at each call; with no active sink the forward alone (or, when the
// recorder names ops, inside the module stack); the call's positional and keyword values as a
// tuple and a dict only when the sink takes them; the innermost module an exception left noted
// on the recorder; the stack popped however the call ends.
PyObject *s_raised_in, *s_module_inputs, *s_module_output, *s_append;

struct Forward {
    PyObject_HEAD
    PyObject *recorder;  // the Recorder: sink (read every call), raised_in (written on errors)
    PyObject *stack;     // the recorder's stack of running modules (a list)
    PyObject *forward;   // what the module's forward was
    PyObject *module, *name, *mtype;
    PyObject *dict;      // instance attributes (the wrapper's bookkeeping: _llmflow_unwrapped)
    vectorcallfunc vectorcall;
    int want_inputs, want_outputs, naming;
};

constexpr PyObject *Forward::*const FORWARD_HELD[] = {&Forward::recorder, &Forward::stack, &Forward::forward,
                                                      &Forward::module, &Forward::name, &Forward::mtype,
                                                      &Forward::dict};

// is ``sink.active`` true: 1, 0, or -1 with an error set
int sink_active(PyObject *sink) {
    PyObject *active = PyObject_GetAttr(sink, s_active);
    if (active == nullptr) return -1;
    int flag = PyObject_IsTrue(active);
    Py_DECREF(active);
    return flag;
}

// ``if stack and stack[-1] == name: stack.pop()``, keeping any exception being raised
void pop_name(Forward *self) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    Py_ssize_t n = PyList_GET_SIZE(self->stack);
    if (n > 0) {
        PyObject *top = PyList_GET_ITEM(self->stack, n - 1);
        int same = top == self->name ? 1 : PyObject_RichCompareBool(top, self->name, Py_EQ);
        if (same == 1) PyList_SetSlice(self->stack, n - 1, n, nullptr);
        PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
}

// ``if recorder.raised_in is None: recorder.raised_in = name``, keeping the exception
void note_raised(Forward *self) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *raised = PyObject_GetAttr(self->recorder, s_raised_in);
    if (raised == Py_None) PyObject_SetAttr(self->recorder, s_raised_in, self->name);
    Py_XDECREF(raised);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

PyObject *Forward_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Forward *self = reinterpret_cast<Forward *>(op);
    PyObject *sink = PyObject_GetAttr(self->recorder, s_recorder_sink);
    if (sink == nullptr) return nullptr;
    int active = sink == Py_None ? 0 : sink_active(sink);
    if (active < 0) {
        Py_DECREF(sink);
        return nullptr;
    }
    if (!active) {
        Py_CLEAR(sink);
        if (!self->naming) return PyObject_Vectorcall(self->forward, args, nargsf, kwnames);
    }
    if (PyList_Append(self->stack, self->name) < 0) {
        Py_XDECREF(sink);
        return nullptr;
    }
    PyObject *values = nullptr, *keywords = nullptr, *output = nullptr, *order = nullptr, *done = nullptr;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (sink != nullptr) {
        if ((order = PyObject_GetAttr(sink, s_exec_order)) == nullptr) goto failed;
        if (order != Py_None) {
            if (PyList_CheckExact(order) ? PyList_Append(order, self->name) < 0
                                         : (done = PyObject_CallMethodOneArg(order, s_append, self->name)) == nullptr)
                goto failed;
            Py_CLEAR(done);
        }
        if (self->want_inputs || self->want_outputs) {  // (args, kwargs) as the closure receives them
            if ((values = PyTuple_New(nargs)) == nullptr || (keywords = PyDict_New()) == nullptr) goto failed;
            for (Py_ssize_t i = 0; i < nargs; i++) {
                Py_INCREF(args[i]);
                PyTuple_SET_ITEM(values, i, args[i]);
            }
            for (Py_ssize_t i = 0; kwnames != nullptr && i < PyTuple_GET_SIZE(kwnames); i++)
                if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) goto failed;
        }
        if (self->want_inputs) {
            PyObject *call[6] = {sink, self->name, self->mtype, self->module, values, keywords};
            done = PyObject_VectorcallMethod(s_module_inputs, call, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
            if (done == nullptr) goto failed;
            Py_CLEAR(done);
        }
    }
    if ((output = PyObject_Vectorcall(self->forward, args, nargsf, kwnames)) == nullptr) goto failed;
    if (self->want_outputs && sink != nullptr) {
        if ((active = sink_active(sink)) < 0) goto failed;
        if (active) {
            PyObject *call[7] = {sink, self->name, self->mtype, self->module, values, keywords, output};
            done = PyObject_VectorcallMethod(s_module_output, call, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
            if (done == nullptr) goto failed;
            Py_CLEAR(done);
        }
    }
    pop_name(self);
    Py_XDECREF(sink);
    Py_XDECREF(order);
    Py_XDECREF(values);
    Py_XDECREF(keywords);
    return output;
failed:
    note_raised(self);
    pop_name(self);
    Py_XDECREF(sink);
    Py_XDECREF(order);
    Py_XDECREF(values);
    Py_XDECREF(keywords);
    Py_XDECREF(output);
    return nullptr;
}

// RecordingForward(recorder, stack, forward, module, name, mtype, want_inputs, want_outputs, naming)
PyObject *Forward_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *recorder, *stack, *forward, *module, *name, *mtype;
    int want_inputs, want_outputs, naming;
    static const char *keywords[] = {"recorder", "stack", "forward", "module", "name", "mtype", "want_inputs",
                                     "want_outputs", "naming", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOUUppp:RecordingForward", const_cast<char **>(keywords),
                                     &recorder, &PyList_Type, &stack, &forward, &module, &name, &mtype,
                                     &want_inputs, &want_outputs, &naming))
        return nullptr;
    if (!PyCallable_Check(forward)) {
        PyErr_SetString(PyExc_TypeError, "RecordingForward(): forward is callable");
        return nullptr;
    }
    Forward *self = reinterpret_cast<Forward *>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    PyObject **slots[6] = {&self->recorder, &self->stack, &self->forward, &self->module, &self->name, &self->mtype};
    PyObject *given[6] = {recorder, stack, forward, module, name, mtype};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(given[i]);
        *slots[i] = given[i];
    }
    self->vectorcall = Forward_call;
    self->want_inputs = want_inputs;
    self->want_outputs = want_outputs;
    self->naming = naming;
    return reinterpret_cast<PyObject *>(self);
}

int Forward_traverse(PyObject *op, visitproc visit, void *arg) { return visit_held(op, FORWARD_HELD, visit, arg); }

int Forward_clear(PyObject *op) {
    clear_held(op, FORWARD_HELD);
    return 0;
}

// copy.copy / copy.deepcopy of a module keep the wrapper itself, as they keep a Python function
PyObject *Forward_same(PyObject *op, PyObject *const *, Py_ssize_t) {
    Py_INCREF(op);
    return op;
}

PyMethodDef Forward_methods[] = {
    {"__copy__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Forward_same)), METH_FASTCALL,
     "The wrapper itself (a function is copied as itself)."},
    {"__deepcopy__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Forward_same)), METH_FASTCALL,
     "The wrapper itself (a function is copied as itself)."},
    {nullptr, nullptr, 0, nullptr}};

// ``__wrapped__``: what inspect.signature reports is the module's own forward's signature, as for
// any wrapper made with functools.wraps (transformers passes an encoder only the keywords its
// forward names)
PyMemberDef Forward_members[] = {
    {const_cast<char *>("__wrapped__"), T_OBJECT, offsetof(Forward, forward), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef Forward_getset[] = {
    {const_cast<char *>("__dict__"), PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject ForwardType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "llmflow_capture",
                          "The dump's capture hot path in C (see capture.cpp).", -1,
                          nullptr, nullptr, nullptr, nullptr, nullptr};

// every interned name above, and its text
struct Name {
    PyObject **slot;
    const char *text;
};
const Name NAMES[] = {
    {&s_version, "_version"}, {&s_dtype, "dtype"}, {&s_is_cpu, "is_cpu"}, {&s_is_contiguous, "is_contiguous"},
    {&s_numel, "numel"}, {&s_data_ptr, "data_ptr"}, {&s_shape, "shape"}, {&s_layout, "layout"},
    {&s_is_neg, "is_neg"}, {&s_is_conj, "is_conj"}, {&s_nbytes, "nbytes"}, {&s_requires_grad, "requires_grad"}, {&s_tensor_slow, "_tensor"},
    {&s_other_slow, "_other"}, {&s_empty, ""}, {&pytype_none, "NoneType"}, {&pytype_bool, "bool"},
    {&pytype_int, "int"}, {&pytype_float, "float"}, {&pytype_dtype, "dtype"}, {&s_param_dtype, "param_dtype"},
    {&s_param, "param"}, {&s_parameter, "Parameter"}, {&pytype_str, "str"}, {&s_name, "__name__"}, {&s_enter, "__enter__"}, {&s_exit, "__exit__"},
    {&s_input, "input"}, {&s_output, "output"}, {&s_module, "module"}, {&s_api, "api"},
    {&s_recorder_sink, "sink"}, {&s_recorder_stack, "stack"}, {&s_recorder_prefix, "prefix"},
    {&s_op_counts, "op_counts"}, {&s_active, "active"}, {&s_wants_op, "wants_op"},
    {&s_exec_order, "exec_order"}, {&s_op_inputs, "op_inputs"}, {&s_op_outputs, "op_output"},
    {&s_raised_in, "raised_in"}, {&s_module_inputs, "module_inputs"}, {&s_module_output, "module_output"},
    {&s_append, "append"}};

// A garbage-collected type, readied and added to the module as ``name``: 0, or -1 with an error
// set. Python classes derive from Entries and Dispatch (Py_TPFLAGS_BASETYPE set beforehand).
int add_type(PyObject *module, PyTypeObject &type, const char *name, Py_ssize_t size, const char *doc,
             newfunc make, destructor dealloc, traverseproc traverse, inquiry clear, PyMethodDef *methods,
             PyMemberDef *members) {
    type.tp_name = name;
    type.tp_basicsize = size;
    type.tp_flags |= Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    type.tp_doc = doc;
    type.tp_new = make;
    type.tp_dealloc = dealloc;
    type.tp_traverse = traverse;
    type.tp_clear = clear;
    type.tp_methods = methods;
    type.tp_members = members;
    if (PyType_Ready(&type) < 0) return -1;
    Py_INCREF(&type);
    if (PyModule_AddObject(module, std::strrchr(name, '.') + 1, reinterpret_cast<PyObject *>(&type)) < 0) {
        Py_DECREF(&type);
        return -1;
    }
    return 0;
}

}  // namespace

PyMODINIT_FUNC PyInit_llmflow_capture(void) {
    for (const Name &name : NAMES)
        if ((*name.slot = PyUnicode_InternFromString(name.text)) == nullptr) return nullptr;
    if ((keyword_labels = PyDict_New()) == nullptr || (child_labels = PyDict_New()) == nullptr) return nullptr;
    for (int i = 0; i < N_POSITIONAL; i++)
        if ((positional[i] = PyUnicode_FromFormat("%d", i)) == nullptr) return nullptr;
    PyObject *m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    EntriesType.tp_flags = DispatchType.tp_flags = Py_TPFLAGS_BASETYPE;
    if (add_type(m, EntriesType, "llmflow_capture.Entries", sizeof(Entries),
                 "A dump session's counters, walks and entries for the common leaves.", Entries_new,
                 dealloc_held<Entries_clear>, Entries_traverse, Entries_clear, Entries_methods, Entries_members) < 0
        || add_type(m, DispatchType, "llmflow_capture.Dispatch", sizeof(Dispatch),
                    "API mode's dispatch of torch calls to its recorder's sink.", PyType_GenericNew,
                    dealloc_held<Dispatch_clear>, Dispatch_traverse, Dispatch_clear, Dispatch_methods, nullptr) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    // a callable (vectorcall) with instance attributes; final (a subclass would not inherit its
    // vectorcall before Python 3.12)
    ForwardType.tp_flags = Py_TPFLAGS_HAVE_VECTORCALL;
    ForwardType.tp_call = PyVectorcall_Call;
    ForwardType.tp_vectorcall_offset = offsetof(Forward, vectorcall);
    ForwardType.tp_dictoffset = offsetof(Forward, dict);
    ForwardType.tp_getset = Forward_getset;
    if (add_type(m, ForwardType, "llmflow_capture.RecordingForward", sizeof(Forward),
                 "The recorder's wrapper around one module's forward (recorder.py's recording_forward).",
                 Forward_new, dealloc_held<Forward_clear>, Forward_traverse, Forward_clear, Forward_methods,
                 Forward_members) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
