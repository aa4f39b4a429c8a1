/* deferfuse._fastpath: the common case of recording one op in defer mode, in C.

NOTE [C record path]: ``TpuTensor.__torch_dispatch__`` is ``dispatch`` below. For the op calls
that make most of a training step (a lowered op on tpu tensors, positional arguments that are
tpu tensors, Python numbers or int lists, an op cache hit whose outputs are new tensors, defer
mode, no cut due) it does what route.torch_dispatch -> dispatch._run -> Trace.record ->
tensor.make do, with the same keys, the same rolling hashes and the same objects, and no Python
frame of its own. Anything else (a miss of the op cache, a keyword argument, an in-place or random
op, a cut due, an input pending in another trace, strict mode, a fake mode) goes to the Python
path unchanged (``py_dispatch``), before any state is touched: the Python path stays the one
definition, and this file is its fast case. It uses CPython's API only (no torch headers), so it
is not tied to torch's ABI.

The Python objects it works on are handed over once by ``setup`` (deferfuse/route.py); they live
as long as the interpreter (the engine is a process singleton).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <pythread.h>
#include <structmember.h>

/* NOTE [hit timing]: with -DDEFERFUSE_HIT_TIMING (a debug build made by bench/cxx_hit_parts.py in
   /tmp, never the shipped one: without the macro the marks compile to nothing), rdtsc marks
   between the sections of record_storages_checked and record(): each mark adds the ticks since the
   last one to its section, one row per recorded hit, read (and cleared) by hit_timing(). The C++
   kernel's sections around it are in _tpu_tensor.cpp (the same NOTE). */
#ifdef DEFERFUSE_HIT_TIMING
#include <x86intrin.h>
enum { R_ENTRY, R_HELD, R_TS, R_LOCK, R_TRACE, R_CHECKS, R_WIRING, R_VALUES, R_SRC, R_NODE,
       R_HASH, R_KNOWN, R_STORAGES, R_DONE, R_UNLOCK, R_EXIT, R_N };
static const char *const R_NAMES[R_N] = {
    "entry: config.c_record, Entry.fast", "interrupt depth in", "engine.local.ts, ts.mode",
    "engine lock acquire", "ts.trace", "record: trace checks, trace_limit", "record: wiring",
    "record: output Values", "record: source-line flag", "record: s0/pos, Node, Value.node, append",
    "record: rolling hashes", "record: known bodies", "record: Storages + weakrefs",
    "record: decrefs", "engine lock release", "decrefs, interrupt depth out"};
#define HT_ROWS (1 << 17)
static unsigned long long ht_last;
static unsigned int ht_cur[R_N];
static unsigned int (*ht_rows)[R_N];
static Py_ssize_t ht_n;
static void ht_mark(int i) {
    unsigned long long now = __rdtsc();
    ht_cur[i] += (unsigned int)(now - ht_last);
    ht_last = now;
}
static void ht_start(void) { memset(ht_cur, 0, sizeof ht_cur); ht_last = __rdtsc(); }
static void ht_row(int keep) {
    if (keep && ht_rows == NULL) ht_rows = calloc(HT_ROWS, sizeof *ht_rows);
    if (keep && ht_rows != NULL && ht_n < HT_ROWS) memcpy(ht_rows[ht_n++], ht_cur, sizeof ht_cur);
    memset(ht_cur, 0, sizeof ht_cur);
}
#define HT_MARK(i) ht_mark(i)
#define HT_START() ht_start()
#define HT_ROW(keep) ht_row(keep)
#else
#define HT_MARK(i) ((void)0)
#define HT_START() ((void)0)
#define HT_ROW(keep) ((void)0)
#endif

/* The records the C path makes without running their Python __init__: each slot written at its
   member offset (checked against the class's __slots__ at setup, so a class that changes makes
   setup fail, not a record with a slot missing). */
typedef struct {
    PyTypeObject *type;
    int n;
    Py_ssize_t off[12];
} Layout;

/* The offsets of the named slots of type (its own __slots__' member descriptors): enough to read
   them (slot_get); layout_of checks the whole list too, for the records made here. */
static int slot_offsets(Layout *L, PyObject *type, const char *const *names, int n) {
    if (!PyType_Check(type) || n > 12) { PyErr_SetString(PyExc_TypeError, "slot_offsets"); return -1; }
    L->type = (PyTypeObject *)type;
    L->n = n;
    for (int i = 0; i < n; i++) {
        PyObject *d = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, names[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
                ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_RuntimeError, "deferfuse._fastpath: %R.%s is not a slot: update "
                         "deferfuse/_fastpath.c (it reads it at every op)", type, names[i]);
            return -1;
        }
        L->off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    return 0;
}

static int layout_of(Layout *L, PyObject *type, const char *const *names, int n) {
    if (!PyType_Check(type) || n > 12) { PyErr_SetString(PyExc_TypeError, "layout_of"); return -1; }
    PyObject *slots = PyObject_GetAttrString(type, "__slots__");
    if (slots == NULL) return -1;
    PyObject *want = PyList_New(0);
    if (want == NULL) { Py_DECREF(slots); return -1; }
    for (int i = 0; i < n; i++) {
        PyObject *nm = PyUnicode_FromString(names[i]);
        if (nm == NULL || PyList_Append(want, nm) < 0) { Py_XDECREF(nm); goto bad; }
        Py_DECREF(nm);
    }
    PyObject *have = PySequence_List(slots);
    if (have == NULL) goto bad;
    PyObject *wr = PyUnicode_FromString("__weakref__");
    Py_ssize_t k = wr ? PySequence_Index(have, wr) : -1;
    Py_XDECREF(wr);
    if (k >= 0) PySequence_DelItem(have, k);
    PyErr_Clear();
    int same = PyObject_RichCompareBool(have, want, Py_EQ);
    Py_DECREF(have);
    if (same != 1) {
        if (same == 0)
            PyErr_Format(PyExc_RuntimeError, "deferfuse._fastpath: %R's __slots__ changed: update "
                         "deferfuse/_fastpath.c (it makes these records)", type);
        goto bad;
    }
    if (slot_offsets(L, type, names, n) < 0) goto bad;
    Py_DECREF(slots); Py_DECREF(want);
    return 0;
bad:
    Py_DECREF(slots); Py_DECREF(want);
    return -1;
}

/* A new instance with its slots set to vals (borrowed: each gets a new reference). */
static PyObject *make_record(Layout *L, PyObject *const *vals) {
    PyObject *o = L->type->tp_alloc(L->type, 0);
    if (o == NULL) return NULL;
    for (int i = 0; i < L->n; i++) {
        Py_INCREF(vals[i]);
        *(PyObject **)((char *)o + L->off[i]) = vals[i];
    }
    return o;
}

static Layout L_value, L_node, L_storage, L_held, L_ts, L_entry;
static const char *const VALUE_SLOTS[] = {"array", "node", "idx", "shape", "dtype", "nbytes",
                                          "err", "chk"};
static const char *const NODE_SLOTS[] = {"key", "ins", "wiring", "s0", "scalars", "outs", "src",
                                         "pos", "trace"};
static const char *const STORAGE_SLOTS[] = {"val", "device", "dtype", "stride", "wr", "ep", "prev"};
/* slots read (and depth written) at every op: runtime.interrupts.Interrupts', engine.ThreadState's
   and dispatch.Entry's */
static const char *const HELD_SLOTS[] = {"main", "depth", "held"};
static const char *const TS_SLOTS[] = {"mode", "trace"};
static const char *const ENTRY_SLOTS[] = {"fast", "res_avals", "khash", "ohash"};

/* ------------------------------------------------------------------ the objects from setup */
/* NOTE [source-line memo]: the user's source line of an op called from a user frame, by the
   frame's code object and instruction offset: what SourceLines.site returns for that frame
   (f"{co_filename}:{f_lineno}", fixed for a code object and an offset). A direct-mapped table of
   SRC_MEMO entries, each holding its code object (so its address is never reused while here) and
   the line. Each entry also names the young generation of engine.sources.codes that was current
   when it was made: a turnover or a clear of that Cache makes every entry a miss, as it drops the
   Cache's own entries (the name is compared, never followed). A hit is a few loads and compares;
   the lookup it replaces (two attribute gets, two ints made, two dict lookups) was ~165 ns an op
   (bench/results/cxx-hit-parts-1207.md). Only a frame that is itself the user's is memoised: a
   line found by walking out of torch's or deferfuse's frames depends on the frames outside, not
   on the code object alone. Python 3.11 and later (PyFrame_GetLasti); counted in stats(). */
#define SRC_MEMO 512
typedef struct {
    PyObject *code;     /* owned */
    int lasti;
    PyObject *young;    /* compared only, never dereferenced */
    PyObject *src;      /* owned */
} SrcMemo;

/* NOTE [thread state memo]: engine.local.ts (a threading.local get, ~75 ns) per op, memoised by
   the calling thread's PyThreadState id (PyThreadState_GetID: unique for the interpreter's life,
   never reused as an address can be, so a new thread never matches a dead thread's entry). Each
   entry holds a weak reference to the ThreadState, never the object itself: a thread's state
   dies with its threading.local slot at the thread's exit, and a dead reference is a miss. The
   entry also names the epoch it was made in: Python bumps it whenever it sets engine.local.ts
   (engine._Local.__setattr__ calls ts_changed()), and setup bumps it, so a replaced state is
   never read from the memo. TS_MEMO entries, direct-mapped by id; counted in stats(). */
#define TS_MEMO 16
typedef struct {
    unsigned long long id, epoch;
    PyObject *wr;           /* owned weak reference to the ThreadState, or NULL */
} TsMemo;

/* NOTE [engine lock in C]: engine.lock is a threading.RLock, whose acquire and release as Python
   calls were ~105 ns a recorded op. Where its C layout is CPython's _thread.RLock (checked by
   setup against the lock's behaviour: owner and count after a Python acquire and release, and
   the type's size), record_storages_checked and try_fast do what its methods do, under the GIL
   as they do: the owner's re-entry counts up, a free lock is taken without blocking; a lock
   another thread holds is waited for through the Python acquire (which releases the GIL and
   handles signals as before, counted in stats()' lock_waits); a release that would fail calls
   the Python release, which raises. Any other layout: the Python calls. */
#if PY_VERSION_HEX < 0x030D0000
typedef struct {
    PyObject_HEAD
    PyThread_type_lock rlock_lock;
    unsigned long rlock_owner;
    unsigned long rlock_count;
    PyObject *in_weakreflist;
} RLockLayout;      /* CPython 3.11/3.12 Modules/_threadmodule.c's rlockobject */
#endif

typedef struct {
    PyObject *tpu_type;     /* TpuTensor */
    PyObject *py_dispatch;  /* route.torch_dispatch(cls, func, types, args, kwargs) */
    PyObject *routes;       /* id(func) -> (handler, OpInfo, func) */
    PyObject *run_fn;       /* dispatch._run: the handler whose calls this file takes */
    PyObject *get_mode;     /* torch._C._get_dispatch_mode */
    PyObject *fake_key;     /* its argument for fake tensor mode */
    PyObject *held;         /* engine.interrupts (NOTE [interrupt safety]) */
    PyObject *local;        /* engine.local: .ts is the thread's state */
    PyObject *lock_acquire, *lock_release;   /* engine.lock's */
    PyObject *ops;          /* engine.ops (a two-generation Cache) */
    PyObject *ts_tag, *ss_tag;               /* runtime.node.TS, SS */
    PyObject *special;      /* opkey._SPECIAL_SCALARS */
    PyObject *const_fn;     /* runtime.node.const */
    PyObject *value_type, *node_type, *storage_type;
    PyObject *wrap;         /* torch.Tensor._make_wrapper_subclass */
    PyObject *strided;      /* torch.strided */
    PyObject *devices;      /* tensor._DEVICES: torch.device("tpu", i) */
    PyObject *config;       /* deferfuse.config.config */
    PyObject *config_dict;  /* its __dict__: the settings (config_get) */
    PyObject *ts_type;      /* engine.ThreadState */
    PyObject *entry_type;   /* dispatch.Entry */
    PyObject *sources;      /* engine.sources (SourceLines) */
    PyObject *defer_str;    /* "defer" */
    PyObject *empty_tuple;
    PyObject *dtype_type, *memory_format_type, *layout_type;   /* kept as they are in keys */
    PyObject *view_fn, *alias_fn;  /* the routes of view ops and of detach/alias */
    PyObject *foreach_fn;          /* the route of in-place foreach ops (route._foreach) */
    PyObject *to_copy_fn;          /* the route of _to_copy (route._to_copy) */
    PyObject *dtype_str, *memory_format_str, *device_str;  /* its keywords */
    PyObject *views, *aliases;     /* engine.views, engine.aliases (Caches) */
    PyObject *moving;              /* view ops with a path of their own (views._MOVING, unbind) */
    PyObject *inference_on;        /* torch.is_inference_mode_enabled */
    PyObject *tensor_type;         /* torch.Tensor */
    PyObject *select_op, *slice_op;    /* aten.select.int, aten.slice.Tensor */
    PyObject *dselect, *dslice;        /* runtime.viewchain.DSELECT, DSLICE */
    PyObject *one, *zero;
    PyObject *loop_boundary;  /* "loop boundary" */
    PyObject *ts_pairs[64]; /* (TS, i) for i < 64 */
    PyObject *source_codes; /* engine.sources.codes (a Cache): its young dict read at its slot */
    SrcMemo src_memo[SRC_MEMO];     /* NOTE [source-line memo] */
    TsMemo ts_memo[TS_MEMO];        /* NOTE [thread state memo] */
    unsigned long long ts_epoch;    /* bumped by ts_changed() and setup */
    PyObject *lock;                 /* engine.lock (NOTE [engine lock in C]) */
    int lock_c;                     /* its layout checked: taken and released here */
    int ready;
    unsigned long long hits, misses, src_memo_hits, src_memo_misses;
    unsigned long long ts_memo_hits, ts_memo_misses, lock_waits;
} FastState;

static FastState S;
static Layout L_cache;
static const char *const CACHE_SLOTS[] = {"young"};

/* interned attribute names */
static PyObject *A_s, *A_device, *A_val, *A_sig, *A_dyn, *A_chain, *A_low, *A_static, *A_rng,
    *A_scalar_pos, *A_mode, *A_trace, *A_cut, *A_nodes, *A_node, *A_pos, *A_idx, *A_array,
    *A_err, *A_fast, *A_dyn_e, *A_res_avals, *A_khash, *A_ohash, *A_scalars, *A_h, *A_hops,
    *A_known, *A_check_at, *A_storages, *A_wr, *A_ext_ids, *A_ext, *A_ext_uses, *A_ts,
    *A_main, *A_depth, *A_held, *A_deliver, *A_young, *A_get, *A_source_lines, *A_trace_limit,
    *A_codes, *A_site, *A_f_lasti, *A_out, *A_cut_body, *A_c_record, *A_mut_kw, *A_scalar_kw, *A_dtype, *A_epoch, *A_ep, *A_prev, *A_returns,
    *A_overwrites, *A_shape, *A_storage_offset;

static int intern_names(void) {
#define I(var, s) if (!(var = PyUnicode_InternFromString(s))) return -1;
    I(A_s, "_s") I(A_device, "device") I(A_val, "val") I(A_sig, "_sig") I(A_dyn, "_dyn")
    I(A_chain, "_chain") I(A_low, "low") I(A_static, "static") I(A_rng, "rng")
    I(A_scalar_pos, "scalar_pos") I(A_mode, "mode") I(A_trace, "trace") I(A_cut, "cut")
    I(A_nodes, "nodes") I(A_node, "node") I(A_pos, "pos") I(A_idx, "idx") I(A_array, "array")
    I(A_err, "err") I(A_fast, "fast") I(A_dyn_e, "dyn") I(A_res_avals, "res_avals")
    I(A_khash, "khash") I(A_ohash, "ohash") I(A_scalars, "scalars") I(A_h, "h")
    I(A_hops, "hops") I(A_known, "_known") I(A_check_at, "check_at") I(A_storages, "storages")
    I(A_wr, "wr") I(A_ext_ids, "_ext_ids") I(A_ext, "ext") I(A_ext_uses, "ext_uses")
    I(A_ts, "ts") I(A_main, "main") I(A_depth, "depth") I(A_held, "held")
    I(A_deliver, "deliver") I(A_young, "young") I(A_get, "get")
    I(A_source_lines, "source_lines") I(A_trace_limit, "trace_limit") I(A_codes, "codes")
    I(A_site, "site") I(A_f_lasti, "f_lasti") I(A_out, "out") I(A_cut_body, "cut_body") I(A_c_record, "c_record") I(A_mut_kw, "mut_kw") I(A_scalar_kw, "scalar_kw") I(A_dtype, "dtype") I(A_epoch, "epoch") I(A_ep, "ep") I(A_prev, "prev")
    I(A_returns, "returns") I(A_overwrites, "overwrites")
    I(A_shape, "shape") I(A_storage_offset, "storage_offset")
#undef I
    return 0;
}

/* An attribute of a tpu tensor: its instance dict first (where make() puts _s, _chain, _sig,
   _dyn), then the class (TpuTensor._dyn's default). Borrowed reference, or NULL (no error set)
   when absent. */
static PyObject *tensor_attr(PyObject *t, PyObject *name) {
    /* generic getattr (no instance dict is materialised); the value stays owned by the tensor or
       its class, so the reference returned is borrowed */
    PyObject *v = PyObject_GetAttr(t, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
        return NULL;
    }
    Py_DECREF(v);
    return v;
}

/* getattr returning a new reference; NULL with the error set */
#define GET(o, n) PyObject_GetAttr((o), (n))

static int is_true_attr(PyObject *o, PyObject *name, int *out) {
    PyObject *v = GET(o, name);
    if (v == NULL) return -1;
    *out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return *out < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------ the op key (dispatch.op_key) */
typedef struct {
    PyObject *tensors, *scalars;    /* lists */
    long dev;                       /* -1: none yet */
    int is_static;
} KeyState;

#define NOT_FAST ((PyObject *)&_Py_NotImplementedStruct)
/* try_moving's answer for a select/slice that does not move (a dimension of one, a slice of
   everything or of nothing): the generic view path takes it, as views.run_view does */
static char generic_tag;
#define GENERIC ((PyObject *)&generic_tag)

/* One argument -> its template entry, as opkey._encode; NOT_FAST (not a new reference) when
   the argument needs the Python path (another device, a CPU tensor, a device object ...). */
static PyObject *encode(PyObject *a, int info_scalar, KeyState *ks) {
    PyTypeObject *ta = Py_TYPE(a);
    if ((PyObject *)ta == S.tpu_type) {
        PyObject *st = tensor_attr(a, A_s);
        if (st == NULL) return PyErr_Occurred() ? NULL : NOT_FAST;
        PyObject *d = GET(st, A_device);
        if (d == NULL) return NULL;
        long dv = PyLong_AsLong(d);
        Py_DECREF(d);
        if (dv == -1 && PyErr_Occurred()) return NULL;
        if (ks->dev == -1) ks->dev = dv;
        else if (ks->dev != dv) return NOT_FAST;     /* the Python path raises */
        Py_ssize_t n = PyList_GET_SIZE(ks->tensors);
        if (PyList_Append(ks->tensors, a) < 0) return NULL;
        if (n >= 64) {      /* a long tensor list (a large optimizer group) */
            PyObject *no = PyLong_FromSsize_t(n);
            if (no == NULL) return NULL;
            PyObject *e = PyTuple_Pack(2, S.ts_tag, no);
            Py_DECREF(no);
            return e;
        }
        Py_INCREF(S.ts_pairs[n]);
        return S.ts_pairs[n];
    }
    if (ta == &PyFloat_Type || ta == &PyLong_Type) {
        if (info_scalar && !ks->is_static) {
            int special = PySet_Contains(S.special, a);
            if (special < 0) return NULL;
            if (!special) {
                PyObject *k = PyLong_FromSsize_t(PyList_GET_SIZE(ks->scalars));
                if (k == NULL) return NULL;
                PyObject *e = PyTuple_Pack(3, S.ss_tag, k, (PyObject *)ta);
                Py_DECREF(k);
                if (e == NULL || PyList_Append(ks->scalars, a) < 0) { Py_XDECREF(e); return NULL; }
                return e;
            }
        }
        return PyObject_CallOneArg(S.const_fn, a);
    }
    if (ta == &PyBool_Type || ta == &PyComplex_Type)
        return PyObject_CallOneArg(S.const_fn, a);
    if (ta == &PyList_Type || ta == &PyTuple_Type) {
        Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
        PyObject **items = PySequence_Fast_ITEMS(a);
        if (m && (PyObject *)Py_TYPE(items[0]) == S.tpu_type) {
            /* a list of tpu tensors on one device: tensor inputs n .. n+m-1 */
            for (Py_ssize_t j = 1; j < m; j++)
                if ((PyObject *)Py_TYPE(items[j]) != S.tpu_type) return NOT_FAST;
        } else if (ks->is_static || !info_scalar) {
            int ints = 1;
            for (Py_ssize_t j = 0; j < m && ints; j++)
                ints = Py_TYPE(items[j]) == &PyLong_Type || items[j] == Py_None;
            if (ints) return ta == &PyTuple_Type ? (Py_INCREF(a), a) : PyList_AsTuple(a);
        }
        PyObject *t = PyTuple_New(m);
        if (t == NULL) return NULL;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *e = encode(items[j], info_scalar, ks);
            if (e == NULL || e == NOT_FAST) { Py_DECREF(t); return e; }
            PyTuple_SET_ITEM(t, j, e);
        }
        return t;
    }
    if (a == Py_None || PyUnicode_CheckExact(a) || (PyObject *)ta == S.dtype_type ||
            (PyObject *)ta == S.memory_format_type || (PyObject *)ta == S.layout_type) {
        Py_INCREF(a);       /* kept as it is */
        return a;
    }
    return NOT_FAST;        /* a CPU tensor, a subclass, a device, anything rarer */
}

/* The key of one op call (dispatch.op_key). Returns 1 and fills *key, *tensors, *scalars, *dev;
   0 when the call is not the fast case; -1 on error. */
static int op_key(PyObject *info, PyObject *args, PyObject *kwargs, PyObject **key,
                  PyObject **tensors_out, PyObject **scalars_out, long *dev_out) {
    int result = -1;
    PyObject *low = NULL, *sp = NULL, *targs = NULL, *tkw = NULL, *sigs = NULL, *dev_obj = NULL;
    KeyState ks = {NULL, NULL, -1, 0};
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);

    low = GET(info, A_low);
    if (low == NULL) goto done;
    if (is_true_attr(low, A_static, &ks.is_static) < 0) goto done;
    sp = GET(info, A_scalar_pos);
    if (sp == NULL) goto done;
    targs = PyTuple_New(nargs);
    ks.tensors = PyList_New(0);
    ks.scalars = PyList_New(0);
    if (!targs || !ks.tensors || !ks.scalars) goto done;

    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int in_sp = 0;
        PyTypeObject *ta = Py_TYPE(a);
        if (ta == &PyFloat_Type || ta == &PyLong_Type || ta == &PyList_Type ||
                ta == &PyTuple_Type) {
            PyObject *io = PyLong_FromSsize_t(i);
            if (io == NULL) goto done;
            in_sp = PySet_Contains(sp, io);
            Py_DECREF(io);
            if (in_sp < 0) goto done;
        }
        PyObject *e = encode(a, in_sp, &ks);
        if (e == NULL) goto done;
        if (e == NOT_FAST) { result = 0; goto done; }
        PyTuple_SET_ITEM(targs, i, e);
    }
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        /* keywords: (name, entry) in the call's order; an op writing an out= keyword is not
           the fast case */
        PyObject *mut_kw = GET(info, A_mut_kw);
        if (mut_kw == NULL) goto done;
        int any = PyObject_IsTrue(mut_kw);
        Py_DECREF(mut_kw);
        if (any) { result = any < 0 ? -1 : 0; goto done; }
        PyObject *skw = GET(info, A_scalar_kw);
        if (skw == NULL) goto done;
        tkw = PyTuple_New(PyDict_GET_SIZE(kwargs));
        if (tkw == NULL) { Py_DECREF(skw); goto done; }
        Py_ssize_t pos = 0, j = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            int in_skw = PySet_Contains(skw, k);
            if (in_skw < 0) { Py_DECREF(skw); goto done; }
            PyObject *e = encode(v, in_skw, &ks);
            if (e == NULL || e == NOT_FAST) {
                Py_DECREF(skw);
                if (e == NOT_FAST) result = 0;
                goto done;
            }
            PyObject *pair = PyTuple_Pack(2, k, e);
            Py_DECREF(e);
            if (pair == NULL) { Py_DECREF(skw); goto done; }
            PyTuple_SET_ITEM(tkw, j++, pair);
        }
        Py_DECREF(skw);
    } else {
        tkw = S.empty_tuple;
        Py_INCREF(tkw);
    }
    if (ks.dev == -1) { result = 0; goto done; }   /* no tensor input: the thread's device */

    Py_ssize_t nt = PyList_GET_SIZE(ks.tensors);
    sigs = PyTuple_New(nt);
    if (sigs == NULL) goto done;
    for (Py_ssize_t j = 0; j < nt; j++) {
        PyObject *s = tensor_attr(PyList_GET_ITEM(ks.tensors, j), A_sig);
        if (s == NULL) { if (PyErr_Occurred()) goto done; result = 0; goto done; }
        Py_INCREF(s);
        PyTuple_SET_ITEM(sigs, j, s);
    }
    dev_obj = PyLong_FromLong(ks.dev);
    if (dev_obj == NULL) goto done;
    *key = PyTuple_Pack(5, info, targs, tkw, sigs, dev_obj);
    if (*key == NULL) goto done;
    *tensors_out = ks.tensors; ks.tensors = NULL;
    *scalars_out = ks.scalars; ks.scalars = NULL;
    *dev_out = ks.dev;
    result = 1;
done:
    Py_XDECREF(low); Py_XDECREF(sp); Py_XDECREF(targs); Py_XDECREF(tkw); Py_XDECREF(ks.tensors);
    Py_XDECREF(ks.scalars); Py_XDECREF(sigs); Py_XDECREF(dev_obj);
    return result;
}

/* A Cache's entry for key (a new reference), Py_None when absent (the Python path fills it). */
static PyObject *cache_get(PyObject *cache, PyObject *key) {
    PyObject *young = GET(cache, A_young);
    if (young == NULL) return NULL;
    PyObject *e = PyDict_GetItemWithError(young, key);
    Py_DECREF(young);
    if (e != NULL) { Py_INCREF(e); return e; }
    if (PyErr_Occurred()) return NULL;
    /* the old generation (promotes the entry): Cache.get */
    PyObject *get = GET(cache, A_get);
    if (get == NULL) return NULL;
    e = PyObject_CallOneArg(get, key);
    Py_DECREF(get);
    return e;
}

/* ------------------------------------------------------------------ source lines (Trace.record) */
static PyObject *source_line(void) {
    /* SourceLines.site, its cached steps in C: walk out from the op's caller past frames of torch
       and deferfuse to the first user frame, and read that frame's line from the cache; anything
       not cached yet goes to site(f), which fills the cache */
    PyFrameObject *f = PyEval_GetFrame();      /* the caller of the op: no frame of ours between */
    if (f == NULL)      /* a thread with no Python caller (autograd's device thread) */
        return PyObject_CallMethodOneArg(S.sources, A_site, Py_None);
    /* NOTE [source-line memo] */
    PyObject *young0 = *(PyObject **)((char *)S.source_codes + L_cache.off[0]);
    PyCodeObject *code0 = PyFrame_GetCode(f);
#if PY_VERSION_HEX >= 0x030B0000
    int lasti0 = PyFrame_GetLasti(f);
#else
    int lasti0 = -1;    /* no memo */
#endif
    SrcMemo *m = &S.src_memo[(((size_t)code0 >> 4) ^ ((size_t)lasti0 * 2654435761u)) % SRC_MEMO];
    if (young0 != NULL && m->code == (PyObject *)code0 && m->lasti == lasti0 && m->young == young0) {
        Py_DECREF(code0);
        S.src_memo_hits++;
        Py_INCREF(m->src);
        return m->src;
    }
    S.src_memo_misses++;
    PyObject *codes = GET(S.sources, A_codes);
    if (codes == NULL) return NULL;
    PyObject *young = GET(codes, A_young);
    Py_DECREF(codes);
    if (young == NULL) return NULL;
    PyObject *src = NULL;
    Py_INCREF(f);
    for (int depth = 0; depth < 64; depth++) {
        PyCodeObject *code = PyFrame_GetCode(f);
        PyObject *id = PyLong_FromVoidPtr(code);
        PyObject *e = id ? PyDict_GetItemWithError(young, id) : NULL;
        Py_XDECREF(id);
        int cached = e != NULL && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 3 &&
                     PyTuple_GET_ITEM(e, 0) == (PyObject *)code;
        Py_DECREF(code);
        if (!cached || PyErr_Occurred()) break;
        if (PyTuple_GET_ITEM(e, 1) == Py_True) {       /* torch's or deferfuse's: go out */
            PyFrameObject *back = PyFrame_GetBack(f);
            if (back == NULL) break;        /* site(f) says '<backward>' */
            Py_DECREF(f);
            f = back;
            continue;
        }
#if PY_VERSION_HEX >= 0x030B0000
        PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
#else
        PyObject *lasti = PyObject_GetAttr((PyObject *)f, A_f_lasti);
#endif
        if (lasti != NULL) {
            src = PyDict_GetItemWithError(PyTuple_GET_ITEM(e, 2), lasti);
            Py_XINCREF(src);
            Py_DECREF(lasti);
        }
        if (depth == 0 && lasti0 >= 0 && src != NULL && young == young0 && PyUnicode_CheckExact(src)) {
            /* the op's caller is the user's frame: memoised (NOTE [source-line memo]) */
            PyObject *old_code = m->code, *old_src = m->src;
            Py_INCREF(code0);
            Py_INCREF(src);
            m->code = (PyObject *)code0;
            m->lasti = lasti0;
            m->young = young0;
            m->src = src;
            Py_XDECREF(old_code);
            Py_XDECREF(old_src);
        }
        break;
    }
    Py_DECREF(code0);
    Py_DECREF(young);
    if (src == NULL && !PyErr_Occurred())
        src = PyObject_CallMethodOneArg(S.sources, A_site, (PyObject *)f);
    Py_DECREF(f);
    return src;
}

/* ------------------------------------------------------------------ rolling hashes */
/* NOTE [rolling hashes in C]: Trace.record extends its hashes as hash((h, khash, wiring, n)) and
   hash((hops, ohash)); every reader (the region cache, body searches, the known bodies) compares
   values made by both paths, as one trace mixes ops recorded in Python and here. So this file
   reproduces CPython's own tuple hash over the items' hashes (Objects/tupleobject.c, the xxHash
   lanes of 3.8 and later) instead of packing a tuple per op only to hash it: the same value, no
   allocation. setup() checks it against hash() of real tuples and, if CPython ever hashes tuples
   otherwise, sets own_hash off and the tuples are packed again. */
static int own_hash = 0, own_hash_checked = 0;

#if SIZEOF_VOID_P > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

/* hash(tuple) from its items' hashes (none of them -1) */
static Py_hash_t tuple_hash_lanes(const Py_hash_t *lanes, Py_ssize_t len) {
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < len; i++) {
        acc += (Py_uhash_t)lanes[i] * XXPRIME_2;
        acc = XXROTATE(acc);
        acc *= XXPRIME_1;
    }
    acc += len ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) return 1546275796;
    return (Py_hash_t)acc;
}

/* hash(n) of a Python int 0 <= n < 2**31 (a count): n itself */
static Py_hash_t small_int_hash(Py_ssize_t n) { return (Py_hash_t)n; }

/* hash(n) of a Python int that fits a Py_hash_t (a rolling hash): |n| mod 2**61 - 1 with n's
   sign, -1 read as -2 (Objects/longobject.c's long_hash on 64-bit builds; checked at setup) */
static Py_hash_t word_int_hash(Py_hash_t x) {
#if SIZEOF_VOID_P > 4
    Py_uhash_t a = x < 0 ? (Py_uhash_t)0 - (Py_uhash_t)x : (Py_uhash_t)x;
    a %= (Py_uhash_t)_PyHASH_MODULUS;
    Py_hash_t r = x < 0 ? -(Py_hash_t)a : (Py_hash_t)a;
    return r == -1 ? -2 : r;
#else
    return x == -1 ? -2 : x;    /* unused: check_own_hash turns own_hash off where this is wrong */
#endif
}

/* the tuple's hash: its lanes, or (own_hash off) hash() of the packed tuple */
static Py_hash_t tuple_hash_of(PyObject *const *items, const Py_hash_t *lanes, Py_ssize_t len) {
    if (own_hash) return tuple_hash_lanes(lanes, len);
    PyObject *t = PyTuple_New(len);
    if (t == NULL) return -1;
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    Py_hash_t hv = PyObject_Hash(t);
    Py_DECREF(t);
    return hv;
}

/* setup's check: the lanes give hash() of real tuples (ints of every size and sign, None, nested
   tuples, lengths 0 to 5) */
static int check_own_hash(void) {
    PyObject *t = Py_BuildValue("((Ln)(LL)(nnOn)(L(nn)On)(nnnnn)())", (long long)-1, (Py_ssize_t)7,
                                (long long)0x7fffffffffffffffLL, (long long)-0x7fffffffffffffffLL,
                                (Py_ssize_t)3, (Py_ssize_t)0, Py_None, (Py_ssize_t)(1 << 30),
                                (long long)0x1234567890abcdefLL, (Py_ssize_t)4, (Py_ssize_t)1,
                                Py_None, (Py_ssize_t)2, (Py_ssize_t)1, (Py_ssize_t)2,
                                (Py_ssize_t)3, (Py_ssize_t)4, (Py_ssize_t)5);
    if (t == NULL) return -1;
    int same = 1;
    for (Py_ssize_t i = 0; same && i < PyTuple_GET_SIZE(t); i++) {
        PyObject *u = PyTuple_GET_ITEM(t, i);
        Py_hash_t lanes[8];
        Py_ssize_t n = PyTuple_GET_SIZE(u);
        for (Py_ssize_t j = 0; j < n; j++) {
            lanes[j] = PyObject_Hash(PyTuple_GET_ITEM(u, j));
            if (lanes[j] == -1) { Py_DECREF(t); return -1; }
        }
        Py_hash_t want = PyObject_Hash(u);
        if (want == -1) { Py_DECREF(t); return -1; }
        same = tuple_hash_lanes(lanes, n) == want;
    }
    /* a rolling hash's (a Py_hash_t held as a C word by TraceState) */
    {
        const long long w[] = {0, 1, -1, -2, 2305843009213693950LL, 2305843009213693951LL,
                               2305843009213693952LL, -2305843009213693951LL,
                               0x7fffffffffffffffLL, -0x7fffffffffffffffLL - 1,
                               0x1234567890abcdefLL, -0x1234567890abcdefLL};
        for (size_t i = 0; same && i < sizeof(w) / sizeof(w[0]); i++) {
            PyObject *o = PyLong_FromLongLong(w[i]);
            if (o == NULL) { Py_DECREF(t); return -1; }
            same = PyObject_Hash(o) == word_int_hash((Py_hash_t)w[i]);
            Py_DECREF(o);
        }
    }
    /* and a count's hash */
    for (Py_ssize_t n = 0; same && n < 70000; n += 4099) {
        PyObject *o = PyLong_FromSsize_t(n);
        if (o == NULL) { Py_DECREF(t); return -1; }
        same = PyObject_Hash(o) == small_int_hash(n);
        Py_DECREF(o);
    }
    Py_DECREF(t);
    own_hash = own_hash_checked = same;
    return 0;
}

/* set_own_hash(on) -> whether it is on: the benches' switch (bench/cxx_kernel_parts.py); on only
   where setup's check passed */
static PyObject *set_own_hash(PyObject *self, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    own_hash = v && own_hash_checked;
    return PyBool_FromLong(own_hash);
}

/* ------------------------------------------------------------------ the trace's per-op state */
/* NOTE [trace state in C]: what Trace.record reads and writes at every op (the pending nodes, the
   external inputs with their use counts and id -> index map, the scalars, the storages to read
   back, the rolling hashes h and hops, the cut due, the device, the next step-detection length
   check_at, the count already in metrics, the epoch, the known loop bodies) are the fields of
   this type, and deferfuse.record.Trace is its Python subclass: the C record path (record()
   below, the plain tensor's kernel through NOTE [C++ node hand-over]) reads them as struct
   fields, where it made ~15 attribute lookups and 3 sets an op on the Trace's instance dict.
   Trace.record in Python reads and writes the same fields through the properties below, so one
   trace still mixes ops recorded by either path with the same values. pos is len(nodes) (no
   second counter to keep in step). The lists stay Python lists (the flush takes them); the use
   counts are a C array that ext_uses copies into a list, and ext_index(v) is the one way to add
   an external input (Python's Trace._external calls it). Everything is replaced at once by
   reset_state(), under the engine's lock as every other write. */
typedef struct { void *key; Py_ssize_t idx; } ExtSlot;

typedef struct {
    PyObject_HEAD
    PyObject *nodes, *ext, *scalars, *storages;     /* lists, never NULL */
    PyObject *cut;          /* None, or the reason of a cut due before the next op */
    PyObject *known;        /* engine.bodies.known (a set) or None */
    PyObject *epoch;        /* an int: storages registered in this trace carry it */
    Py_hash_t h, hops;
    long device;            /* -1: none yet */
    Py_ssize_t check_at, counted;
    ExtSlot *tab;           /* id(v) -> index in ext, open addressing; cap a power of two */
    Py_ssize_t tab_cap;
    Py_ssize_t *uses;       /* per external input, the node inputs reading it */
    Py_ssize_t uses_cap;
    Py_ssize_t n_ext;       /* inputs registered by ext_index: len(ext) unless ext was changed
                               by hand, which ext_index and ext_uses refuse */
} TraceState;

static PyTypeObject TraceStateType;

static int ts_fresh(TraceState *t) {
    PyObject *n = PyList_New(0), *e = PyList_New(0), *s = PyList_New(0), *st = PyList_New(0);
    if (!n || !e || !s || !st) { Py_XDECREF(n); Py_XDECREF(e); Py_XDECREF(s); Py_XDECREF(st); return -1; }
    Py_XSETREF(t->nodes, n); Py_XSETREF(t->ext, e); Py_XSETREF(t->scalars, s);
    Py_XSETREF(t->storages, st);
    Py_INCREF(Py_None); Py_XSETREF(t->cut, Py_None);
    t->h = t->hops = 0;
    t->device = -1;
    t->counted = 0;
    t->n_ext = 0;
    if (t->tab_cap > 4096) {       /* a trace with many external inputs: do not keep its size */
        PyMem_Free(t->tab); PyMem_Free(t->uses);
        t->tab = NULL; t->uses = NULL; t->tab_cap = t->uses_cap = 0;
    } else if (t->tab != NULL) {
        memset(t->tab, 0, t->tab_cap * sizeof(ExtSlot));
    }
    return 0;
}

static PyObject *ts_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    TraceState *t = (TraceState *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    Py_INCREF(Py_None); t->known = Py_None;
    t->epoch = PyLong_FromLong(0);
    t->check_at = 0;
    if (t->epoch == NULL || ts_fresh(t) < 0) { Py_DECREF(t); return NULL; }
    return (PyObject *)t;
}

static int ts_traverse(TraceState *t, visitproc visit, void *arg) {
    Py_VISIT(t->nodes); Py_VISIT(t->ext); Py_VISIT(t->scalars); Py_VISIT(t->storages);
    Py_VISIT(t->cut); Py_VISIT(t->known); Py_VISIT(t->epoch);
    return 0;
}

static int ts_clear(TraceState *t) {
    Py_CLEAR(t->nodes); Py_CLEAR(t->ext); Py_CLEAR(t->scalars); Py_CLEAR(t->storages);
    Py_CLEAR(t->cut); Py_CLEAR(t->known); Py_CLEAR(t->epoch);
    return 0;
}

static void ts_dealloc(TraceState *t) {
    PyObject_GC_UnTrack(t);
    ts_clear(t);
    PyMem_Free(t->tab);
    PyMem_Free(t->uses);
    Py_TYPE(t)->tp_free((PyObject *)t);     /* a subclass's dealloc drops its type's reference */
}

/* the index of the external input v, registered (use count 1) if new, else its count + 1; -1 on
   error. ext holds v, so its address names it while it is in the map. */
static Py_ssize_t ts_ext_index(TraceState *t, PyObject *v) {
    if (t->ext == NULL) { PyErr_SetString(PyExc_RuntimeError, "deferfuse: a cleared trace"); return -1; }
    Py_ssize_t n = t->n_ext;
    if (PyList_GET_SIZE(t->ext) != n) {
        PyErr_SetString(PyExc_RuntimeError, "deferfuse: Trace.ext changed outside ext_index");
        return -1;
    }
    if (2 * (n + 1) > t->tab_cap) {        /* grow: at most half full */
        Py_ssize_t cap = t->tab_cap ? 2 * t->tab_cap : 64;
        ExtSlot *tab = PyMem_Calloc(cap, sizeof(ExtSlot));
        if (tab == NULL) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t i = 0; i < n; i++) {
            void *k = PyList_GET_ITEM(t->ext, i);
            size_t j = ((size_t)k >> 4) & (cap - 1);
            while (tab[j].key != NULL) j = (j + 1) & (cap - 1);
            tab[j].key = k; tab[j].idx = i;
        }
        PyMem_Free(t->tab);
        t->tab = tab; t->tab_cap = cap;
    }
    size_t j = ((size_t)v >> 4) & (t->tab_cap - 1);
    while (t->tab[j].key != NULL) {
        if (t->tab[j].key == (void *)v) {
            t->uses[t->tab[j].idx]++;
            return t->tab[j].idx;
        }
        j = (j + 1) & (t->tab_cap - 1);
    }
    if (n + 1 > t->uses_cap) {
        Py_ssize_t cap = t->uses_cap ? 2 * t->uses_cap : 64;
        Py_ssize_t *u = PyMem_Realloc(t->uses, cap * sizeof(Py_ssize_t));
        if (u == NULL) { PyErr_NoMemory(); return -1; }
        t->uses = u; t->uses_cap = cap;
    }
    if (PyList_Append(t->ext, v) < 0) return -1;
    t->tab[j].key = v; t->tab[j].idx = n;
    t->uses[n] = 1;
    t->n_ext = n + 1;
    return n;
}

static PyObject *ts_ext_index_py(TraceState *t, PyObject *v) {
    Py_ssize_t i = ts_ext_index(t, v);
    return i < 0 ? NULL : PyLong_FromSsize_t(i);
}

static PyObject *ts_reset_state(TraceState *t, PyObject *unused) {
    if (ts_fresh(t) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ts_get_list(TraceState *t, void *off) {
    PyObject *v = *(PyObject **)((char *)t + (Py_ssize_t)off);
    if (v == NULL) { PyErr_SetString(PyExc_AttributeError, "deferfuse: a cleared trace"); return NULL; }
    Py_INCREF(v);
    return v;
}

static PyObject *ts_get_ext_uses(TraceState *t, void *unused) {
    if (t->ext == NULL) { PyErr_SetString(PyExc_AttributeError, "deferfuse: a cleared trace"); return NULL; }
    Py_ssize_t n = t->n_ext;
    if (PyList_GET_SIZE(t->ext) != n) {
        PyErr_SetString(PyExc_RuntimeError, "deferfuse: Trace.ext changed outside ext_index");
        return NULL;
    }
    PyObject *l = PyList_New(n);
    if (l == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyLong_FromSsize_t(t->uses[i]);
        if (c == NULL) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, i, c);
    }
    return l;
}

static PyObject *ts_get_cut(TraceState *t, void *unused) { return Py_NewRef(t->cut ? t->cut : Py_None); }
static int ts_set_cut(TraceState *t, PyObject *v, void *unused) {
    if (v == NULL) { PyErr_SetString(PyExc_AttributeError, "Trace.cut cannot be deleted"); return -1; }
    Py_INCREF(v); Py_SETREF(t->cut, v);
    return 0;
}

static PyObject *ts_get_known(TraceState *t, void *unused) { return Py_NewRef(t->known ? t->known : Py_None); }
static int ts_set_known(TraceState *t, PyObject *v, void *unused) {
    if (v == NULL || (v != Py_None && !PyAnySet_CheckExact(v))) {
        PyErr_SetString(PyExc_TypeError, "Trace._known: a set or None");
        return -1;
    }
    Py_INCREF(v); Py_SETREF(t->known, v);
    return 0;
}

static PyObject *ts_get_epoch(TraceState *t, void *unused) { return Py_NewRef(t->epoch ? t->epoch : Py_None); }
static int ts_set_epoch(TraceState *t, PyObject *v, void *unused) {
    if (v == NULL || !PyLong_CheckExact(v)) {
        PyErr_SetString(PyExc_TypeError, "Trace.epoch: an int");
        return -1;
    }
    Py_INCREF(v); Py_SETREF(t->epoch, v);
    return 0;
}

static PyObject *ts_get_device(TraceState *t, void *unused) {
    if (t->device < 0) Py_RETURN_NONE;
    return PyLong_FromLong(t->device);
}
static int ts_set_device(TraceState *t, PyObject *v, void *unused) {
    if (v == Py_None) { t->device = -1; return 0; }
    long d = v != NULL && PyLong_CheckExact(v) ? PyLong_AsLong(v) : -1;
    if (d < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "Trace.device: None or a device index (an int >= 0)");
        return -1;
    }
    t->device = d;
    return 0;
}

/* h, hops: any int hash() returns (a Py_hash_t) */
static PyObject *ts_get_hash(TraceState *t, void *off) {
    return PyLong_FromSsize_t(*(Py_hash_t *)((char *)t + (Py_ssize_t)off));
}
/* check_at, counted: counts */
static PyObject *ts_get_count(TraceState *t, void *off) {
    return PyLong_FromSsize_t(*(Py_ssize_t *)((char *)t + (Py_ssize_t)off));
}
static int ts_set_word(TraceState *t, PyObject *v, void *off) {
    if (v == NULL || !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "Trace: an int");
        return -1;
    }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *(Py_ssize_t *)((char *)t + (Py_ssize_t)off) = x;
    return 0;
}

#define TS_OFF(f) ((void *)offsetof(TraceState, f))
static PyGetSetDef ts_getset[] = {
    {"nodes", (getter)ts_get_list, NULL, "the pending Nodes, in order (a list)", TS_OFF(nodes)},
    {"ext", (getter)ts_get_list, NULL, "the external input Values (a list)", TS_OFF(ext)},
    {"scalars", (getter)ts_get_list, NULL, "the runtime scalars of all nodes (a list)", TS_OFF(scalars)},
    {"storages", (getter)ts_get_list, NULL, "weak refs of storages that may hold pending values",
     TS_OFF(storages)},
    {"ext_uses", (getter)ts_get_ext_uses, NULL,
     "node inputs reading each external value (a new list: the donation check's counts)", NULL},
    {"cut", (getter)ts_get_cut, (setter)ts_set_cut, "a cut decided at the last op, made before the next one", NULL},
    {"_known", (getter)ts_get_known, (setter)ts_set_known, "engine.bodies.known, read at every op", NULL},
    {"epoch", (getter)ts_get_epoch, (setter)ts_set_epoch, "the trace's epoch (Storage.ep)", NULL},
    {"device", (getter)ts_get_device, (setter)ts_set_device, "the device of its ops, or None", NULL},
    {"h", (getter)ts_get_hash, (setter)ts_set_word, "rolling hash over structure and wiring", TS_OFF(h)},
    {"hops", (getter)ts_get_hash, (setter)ts_set_word, "rolling hash over structure without sizes",
     TS_OFF(hops)},
    {"check_at", (getter)ts_get_count, (setter)ts_set_word, "next length to look for a loop body at",
     TS_OFF(check_at)},
    {"counted", (getter)ts_get_count, (setter)ts_set_word, "nodes already in S['ops_recorded']",
     TS_OFF(counted)},
    {NULL}};
#undef TS_OFF

static PyMethodDef ts_methods[] = {
    {"ext_index", (PyCFunction)ts_ext_index_py, METH_O,
     "The external-input index of the concrete Value v (registered if new), its use count + 1."},
    {"reset_state", (PyCFunction)ts_reset_state, METH_NOARGS,
     "Empty: fresh lists, no external inputs, hashes 0, no cut, no device, counted 0."},
    {NULL}};

static PyTypeObject TraceStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deferfuse._fastpath.TraceState",
    .tp_doc = "NOTE [trace state in C]: the per-op state of a pending trace (deferfuse.record.Trace's base).",
    .tp_basicsize = sizeof(TraceState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = ts_new,
    .tp_traverse = (traverseproc)ts_traverse,
    .tp_clear = (inquiry)ts_clear,
    .tp_dealloc = (destructor)ts_dealloc,
    .tp_getset = ts_getset,
    .tp_methods = ts_methods,
};

/* A slot of a record made by Python or by make_record (Value, Node): read at its offset when the
   object is of the exact class whose layout setup checked, else by a generic get (a subclass, or
   an unset slot, raises as Python would). New reference. */
static PyObject *slot_get(Layout *L, int k, PyObject *o, PyObject *name) {
    if (Py_IS_TYPE(o, L->type)) {
        PyObject *v = *(PyObject **)((char *)o + L->off[k]);
        if (v != NULL) { Py_INCREF(v); return v; }
    }
    return GET(o, name);
}

/* A setting of deferfuse.config (its instance dict: the settings are plain entries there, and
   the generic get passes through _Config's __getattr__ hook first); borrowed, NULL with an error
   set if absent. */
static PyObject *config_get(PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(S.config_dict, name);
    if (v == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return v;
}

/* ------------------------------------------------------------------ recording (Trace.record) */
/* The fast case of Trace.record(entry, ins, scalars, dev) followed by _run's per-output Storage
   and make(). Returns the op's result, Py_NotImplemented when it is not the fast case (nothing
   was changed), NULL on error. The caller holds the engine's lock. storages_only (the plain
   tensor's C++ kernel, record_storages): the new outputs' Storages, a tuple, no tensors made;
   2: the output Values, a tuple (NOTE [lazy storages] in _tpu_tensor.cpp). The trace's state is read and written as fields (NOTE [trace state in C]). */
static PyObject *record(PyObject *trace, PyObject *entry, PyObject *fast, PyObject *ins,
                        PyObject *scalars, long dev, PyObject *tensors, PyObject *mut,
                        PyObject *info, PyObject *args, PyObject *kwargs, int storages_only) {
    PyObject *result = NULL, *nodes = NULL, *wiring = NULL, *res = NULL, *outs = NULL,
             *src = NULL, *node = NULL, *tscalars = NULL, *khash = NULL, *ohash = NULL,
             *dev_obj = NULL, *s0 = NULL, *pos_obj = NULL, *storages = NULL, *made = NULL;
    Py_ssize_t n_in = PyList_GET_SIZE(ins);
    if (!PyObject_TypeCheck(trace, &TraceStateType)) {
        PyErr_Format(PyExc_TypeError, "deferfuse: %R is not a Trace", trace);
        return NULL;
    }
    TraceState *T = (TraceState *)trace;
    if (T->nodes == NULL || T->cut != Py_None) Py_RETURN_NOTIMPLEMENTED;   /* a cut due */
    /* the lists stay held while this runs, whatever Python code a hash or a decref may run */
    nodes = T->nodes; Py_INCREF(nodes);
    tscalars = T->scalars; Py_INCREF(tscalars);
    storages = T->storages; Py_INCREF(storages);
    Py_ssize_t pos = PyList_GET_SIZE(nodes);
    if (pos > 0 && T->device != dev) { result = Py_NotImplemented; Py_INCREF(result); goto done; }
    /* The next op's checks (Trace.record's tail): a due check of the trace for a loop body goes
       to the Python path, which records this op and then looks. */
    PyObject *limit_o = config_get(A_trace_limit);
    if (limit_o == NULL) goto done;
    Py_ssize_t limit = PyLong_AsSsize_t(limit_o);
    if (limit == -1 && PyErr_Occurred()) goto done;
    if (pos + 1 == T->check_at || pos + 1 >= limit) {
        result = Py_NotImplemented; Py_INCREF(result); goto done;
    }
    dev_obj = PyLong_FromLong(dev);
    if (dev_obj == NULL) goto done;
    HT_MARK(R_CHECKS);

    /* wiring: per input, (pos, idx) of a node of this trace, or an external input's index.
       A first pass decides (an input pending in another trace, or failed, donated or empty, goes
       to the Python path before anything changed); the second registers external inputs. */
    wiring = PyTuple_New(n_in);
    if (wiring == NULL) goto done;
    for (Py_ssize_t i = 0; i < n_in; i++) {
        PyObject *v = PyList_GET_ITEM(ins, i);
        PyObject *w = NULL;
        if (v == Py_None) {     /* a written input overwritten whole: not read */
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(wiring, i, Py_None);
            continue;
        }
        PyObject *n = slot_get(&L_value, 1, v, A_node);
        if (n == NULL) goto done;
        if (n != Py_None) {
            PyObject *p = slot_get(&L_node, 7, n, A_pos);
            if (p == NULL) { Py_DECREF(n); goto done; }
            Py_ssize_t pi = PyLong_AsSsize_t(p);
            if (pi >= 0 && pi < pos && PyList_GET_ITEM(nodes, pi) == n) {
                PyObject *idx = slot_get(&L_value, 2, v, A_idx);
                if (idx == NULL) { Py_DECREF(p); Py_DECREF(n); goto done; }
                w = PyTuple_Pack(2, p, idx);
                Py_DECREF(idx);
            }
            Py_DECREF(p);
            Py_DECREF(n);
            if (w == NULL) {
                if (PyErr_Occurred()) goto done;
                result = Py_NotImplemented; Py_INCREF(result); goto done;   /* another trace's */
            }
            PyTuple_SET_ITEM(wiring, i, w);
        } else {
            Py_DECREF(n);
            PyObject *arr = slot_get(&L_value, 0, v, A_array);
            if (arr == NULL) goto done;
            int absent = arr == Py_None;
            Py_DECREF(arr);
            if (absent) {   /* failed, donated or empty: the Python path */
                result = Py_NotImplemented; Py_INCREF(result); goto done;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n_in; i++) {
        if (PyTuple_GET_ITEM(wiring, i) != NULL) continue;
        Py_ssize_t k = ts_ext_index(T, PyList_GET_ITEM(ins, i));
        PyObject *w = k < 0 ? NULL : PyLong_FromSsize_t(k);
        if (w == NULL) goto done;
        PyTuple_SET_ITEM(wiring, i, w);
    }

    HT_MARK(R_WIRING);
    /* output Values */
    res = slot_get(&L_entry, 1, entry, A_res_avals);
    if (res == NULL) goto done;
    Py_ssize_t n_out = PyTuple_GET_SIZE(res);
    outs = PyTuple_New(n_out);
    if (outs == NULL) goto done;
    for (Py_ssize_t k = 0; k < n_out; k++) {
        PyObject *a = PyTuple_GET_ITEM(res, k);
        PyObject *o;
        if (a == Py_None) {
            o = Py_None; Py_INCREF(o);
        } else {
            /* Value(shape, dtype, nbytes, idx=k): pending, its node set below */
            PyObject *ko = PyLong_FromSsize_t(k);
            if (ko == NULL) goto done;
            PyObject *vals[8] = {Py_None, Py_None, ko, PyTuple_GET_ITEM(a, 0),
                                 PyTuple_GET_ITEM(a, 1), PyTuple_GET_ITEM(a, 2), Py_None, Py_None};
            o = make_record(&L_value, vals);
            Py_DECREF(ko);
        }
        if (o == NULL) goto done;
        PyTuple_SET_ITEM(outs, k, o);
    }

    HT_MARK(R_VALUES);
    /* the user's source line (NOTE [record depth] in record.py) */
    PyObject *lines_o = config_get(A_source_lines);
    int lines = lines_o == NULL ? -1 : PyObject_IsTrue(lines_o);
    if (lines < 0) goto done;
    if (lines) {
        src = source_line();
        if (src == NULL) goto done;
    } else {
        src = Py_None; Py_INCREF(src);
    }

    HT_MARK(R_SRC);
    s0 = PyLong_FromSsize_t(PyList_GET_SIZE(tscalars));
    pos_obj = PyLong_FromSsize_t(pos);
    if (s0 == NULL || pos_obj == NULL) goto done;
    {
        PyObject *vals[9] = {entry, ins, wiring, s0, scalars, outs, src, pos_obj, trace};
        node = make_record(&L_node, vals);
    }
    if (node == NULL) goto done;
    for (Py_ssize_t k = 0; k < n_out; k++) {
        /* Value.node: the slot written at its offset (the Value was made above, its node None) */
        PyObject *o = PyTuple_GET_ITEM(outs, k);
        if (o == Py_None) continue;
        Py_INCREF(node);
        Py_XSETREF(*(PyObject **)((char *)o + L_value.off[1]), node);
    }
    T->device = dev;
    if (PyList_Append(nodes, node) < 0) goto done;
    Py_ssize_t ns = PyList_GET_SIZE(scalars);
    if (ns && PyList_SetSlice(tscalars, PyList_GET_SIZE(tscalars), PyList_GET_SIZE(tscalars),
                                scalars) < 0)
        goto done;

    HT_MARK(R_NODE);
    /* the rolling hashes: h over structure and wiring, hops over structure without sizes */
    khash = slot_get(&L_entry, 2, entry, A_khash);
    ohash = slot_get(&L_entry, 3, entry, A_ohash);
    if (!khash || !ohash) goto done;
    {
        /* hash((h, khash, wiring, ns)) and hash((hops, ohash)), NOTE [rolling hashes in C] */
        Py_hash_t hv, hopv, lanes[4];
        lanes[0] = word_int_hash(T->h);
        lanes[1] = PyObject_Hash(khash);
        lanes[2] = PyObject_Hash(wiring);
        lanes[3] = small_int_hash(ns);
        if (lanes[1] == -1 || lanes[2] == -1) goto done;
        if (own_hash) {
            hv = tuple_hash_lanes(lanes, 4);
        } else {
            PyObject *ho = PyLong_FromSsize_t(T->h), *nso = PyLong_FromSsize_t(ns);
            PyObject *items[4] = {ho, khash, wiring, nso};
            hv = ho && nso ? tuple_hash_of(items, lanes, 4) : -1;
            Py_XDECREF(ho); Py_XDECREF(nso);
            if (hv == -1 && PyErr_Occurred()) goto done;
        }
        lanes[0] = word_int_hash(T->hops);
        lanes[1] = PyObject_Hash(ohash);
        if (lanes[1] == -1) goto done;
        if (own_hash) {
            hopv = tuple_hash_lanes(lanes, 2);
        } else {
            PyObject *ho = PyLong_FromSsize_t(T->hops);
            PyObject *items[2] = {ho, ohash};
            hopv = ho ? tuple_hash_of(items, lanes, 2) : -1;
            Py_XDECREF(ho);
            if (hopv == -1 && PyErr_Occurred()) goto done;
        }
        T->h = hv;
        T->hops = hopv;
    }
    HT_MARK(R_HASH);
    /* a known loop body ends here: cut before the next op */
    if (T->known != NULL && T->known != Py_None && PySet_GET_SIZE(T->known) > 0) {
        PyObject *p1 = PyLong_FromSsize_t(pos + 1), *ho = PyLong_FromSsize_t(T->hops);
        PyObject *b = p1 && ho ? PyTuple_Pack(2, p1, ho) : NULL;
        Py_XDECREF(p1); Py_XDECREF(ho);
        if (b == NULL) goto done;
        int in = PySet_Contains(T->known, b);
        if (in > 0) {
            if (PyObject_SetAttr(trace, A_cut_body, b) < 0) in = -1;
            else { Py_INCREF(S.loop_boundary); Py_SETREF(T->cut, S.loop_boundary); }
        }
        Py_DECREF(b);
        if (in < 0) goto done;
    }

    HT_MARK(R_KNOWN);
    if (fast == Py_None) {
        /* an op that writes its inputs (dispatch._bind): each written storage takes its new
           value (Trace.track_mut first), and the op returns the arguments it names */
        PyObject *epoch = T->epoch;
        if (epoch == NULL) goto done;
        Py_INCREF(epoch);
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(mut) && k < n_out; k++) {
            Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(mut, k));
            /* storages_only: tensors is the written Storages, one per entry of mut */
            PyObject *st = m < 0 ? NULL : storages_only ? PyList_GET_ITEM(tensors, k)
                                                        : tensor_attr(PyList_GET_ITEM(tensors, m), A_s);
            if (st == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "deferfuse: no storage");
                Py_DECREF(epoch); goto done;
            }
            PyObject *ep = GET(st, A_ep);
            if (ep == NULL) { Py_DECREF(epoch); goto done; }
            int same = PyObject_RichCompareBool(ep, epoch, Py_EQ);
            Py_DECREF(ep);
            if (same < 0) { Py_DECREF(epoch); goto done; }
            if (!same) {
                PyObject *old = GET(st, A_val), *wr = GET(st, A_wr);
                PyObject *prev = old ? PyLong_FromVoidPtr(old) : NULL;
                int bad = !old || !wr || !prev || PyObject_SetAttr(st, A_ep, epoch) < 0 ||
                          PyObject_SetAttr(st, A_prev, prev) < 0 || PyList_Append(storages, wr) < 0;
                Py_XDECREF(old); Py_XDECREF(wr); Py_XDECREF(prev);
                if (bad) { Py_DECREF(epoch); goto done; }
            }
            if (PyObject_SetAttr(st, A_val, PyTuple_GET_ITEM(outs, k)) < 0) {
                Py_DECREF(epoch); goto done;
            }
        }
        Py_DECREF(epoch);
        if (storages_only) { result = Py_None; Py_INCREF(result); goto done; }
        PyObject *rets = GET(info, A_returns);
        if (rets == NULL) goto done;
        Py_ssize_t nr = rets == Py_None ? 0 : PySequence_Size(rets);
        if (nr < 0) { Py_DECREF(rets); goto done; }
        if (nr == 0) { Py_DECREF(rets); result = Py_None; Py_INCREF(result); goto done; }
        PyObject *tup = PyTuple_New(nr);
        if (tup == NULL) { Py_DECREF(rets); goto done; }
        for (Py_ssize_t j = 0; j < nr; j++) {
            PyObject *r = PySequence_GetItem(rets, j), *a = NULL;
            if (r == NULL) { Py_DECREF(tup); Py_DECREF(rets); goto done; }
            if (r == Py_None) {
                a = Py_None; Py_INCREF(a);
            } else {
                int kw = PyObject_IsTrue(PyTuple_GET_ITEM(r, 2));
                if (kw > 0) {
                    a = kwargs ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(r, 1)) : NULL;
                    if (a == NULL && !PyErr_Occurred())
                        PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(r, 1));
                    Py_XINCREF(a);
                } else if (kw == 0) {
                    Py_ssize_t ai = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 0));
                    a = ai >= 0 && ai < PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, ai) : NULL;
                    if (a == NULL && !PyErr_Occurred())
                        PyErr_SetString(PyExc_IndexError, "deferfuse: returned argument");
                    Py_XINCREF(a);
                }
            }
            Py_DECREF(r);
            if (a == NULL) { Py_DECREF(tup); Py_DECREF(rets); goto done; }
            PyTuple_SET_ITEM(tup, j, a);
        }
        Py_DECREF(rets);
        if (nr == 1) { result = PyTuple_GET_ITEM(tup, 0); Py_INCREF(result); Py_DECREF(tup); }
        else result = tup;
        goto done;
    }
    if (storages_only == 2) {
        /* NOTE [lazy storages] in _tpu_tensor.cpp: the output Values themselves; each output's
           storage context holds its Value, and its Storage is made on a reader's first ask */
        HT_MARK(R_STORAGES);
        result = outs;
        Py_INCREF(outs);
        goto done;
    }
    /* the outputs: a Storage and a tensor each (_run's fast path and tensor.make) */
    int one = PyTuple_CheckExact(fast);
    Py_ssize_t n_made = one ? 1 : PyList_GET_SIZE(fast);
    if (n_made > n_out) n_made = n_out;
    made = PyTuple_New(n_made);
    if (made == NULL) goto done;
    PyObject *device = PyList_GetItem(S.devices, dev);
    if (device == NULL) goto done;
    for (Py_ssize_t k = 0; k < n_made; k++) {
        PyObject *m = one ? fast : PyList_GET_ITEM(fast, k);
        if (m == Py_None) {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(made, k, Py_None);
            continue;
        }
        PyObject *dtype = PyTuple_GET_ITEM(m, 0), *size = PyTuple_GET_ITEM(m, 1),
                 *stride = PyTuple_GET_ITEM(m, 2), *sig = PyTuple_GET_ITEM(m, 3);
        /* Storage(value, dev, dtype, stride): wr its own weak reference, ep and prev 0 */
        PyObject *zero = S.zero;
        PyObject *svals[7] = {PyTuple_GET_ITEM(outs, k), dev_obj, dtype, stride, Py_None, zero, zero};
        PyObject *st = make_record(&L_storage, svals);
        if (st == NULL) goto done;
        PyObject *wr = PyWeakref_NewRef(st, NULL);
        if (wr == NULL) { Py_DECREF(st); goto done; }
        Py_SETREF(*(PyObject **)((char *)st + L_storage.off[4]), wr);
        if (PyList_Append(storages, wr) < 0) { Py_DECREF(st); goto done; }
        if (storages_only) {
            PyTuple_SET_ITEM(made, k, st);
            continue;
        }
        PyObject *wargs[8] = {S.tpu_type, size, stride, Py_None, Py_None, dtype, S.strided, device};
        PyObject *t = PyObject_Vectorcall(S.wrap, wargs, 8, NULL);
        if (t == NULL) { Py_DECREF(st); goto done; }
        if (PyObject_SetAttr(t, A_s, st) < 0 || PyObject_SetAttr(t, A_chain, S.empty_tuple) < 0 ||
                PyObject_SetAttr(t, A_sig, sig) < 0) {
            Py_DECREF(st); Py_DECREF(t); goto done;
        }
        Py_DECREF(st);
        PyTuple_SET_ITEM(made, k, t);
    }
    if (storages_only) {
        HT_MARK(R_STORAGES);
        result = made;
        Py_INCREF(made);
    } else if (one) {
        result = PyTuple_GET_ITEM(made, 0);
        Py_INCREF(result);
    } else {
        PyObject *o = GET(entry, A_out);        /* ((structure, metas), ...): a list or a tuple */
        if (o == NULL) goto done;
        PyObject *structure = PyTuple_GET_ITEM(PyTuple_GET_ITEM(o, 0), 0);
        int is_list = PyUnicode_CompareWithASCIIString(structure, "list") == 0;
        Py_DECREF(o);
        if (is_list) result = PySequence_List(made);
        else { result = made; Py_INCREF(made); }
    }
done:
    Py_XDECREF(nodes); Py_XDECREF(wiring); Py_XDECREF(res); Py_XDECREF(outs); Py_XDECREF(src);
    Py_XDECREF(node); Py_XDECREF(tscalars); Py_XDECREF(khash); Py_XDECREF(ohash);
    Py_XDECREF(dev_obj); Py_XDECREF(s0); Py_XDECREF(pos_obj); Py_XDECREF(storages);
    Py_XDECREF(made);
    HT_MARK(R_DONE);
    return result;
}

/* ------------------------------------------------------------------ interrupts (depth) */
/* engine.local.ts, a new reference (NOTE [thread state memo]), or NULL with the error set. */
static PyObject *thread_ts(void) {
    unsigned long long id = PyThreadState_GetID(PyThreadState_Get());
    TsMemo *m = &S.ts_memo[id % TS_MEMO];
    if (m->wr != NULL && m->id == id && m->epoch == S.ts_epoch) {
        PyObject *ts = PyWeakref_GET_OBJECT(m->wr);
        if (ts != Py_None) {
            S.ts_memo_hits++;
            return Py_NewRef(ts);
        }
    }
    PyObject *ts = GET(S.local, A_ts);
    if (ts == NULL) return NULL;
    /* after the get: a thread's first get runs _Local.__init__, which sets ts (a bump) to this */
    unsigned long long epoch = S.ts_epoch;
    S.ts_memo_misses++;
    if (Py_IS_TYPE(ts, (PyTypeObject *)S.ts_type)) {
        PyObject *wr = PyWeakref_NewRef(ts, NULL);
        if (wr == NULL) { Py_DECREF(ts); return NULL; }
        Py_XSETREF(m->wr, wr);
        m->id = id;
        m->epoch = epoch;
    }
    return ts;
}

/* engine.lock.acquire() (NOTE [engine lock in C]); -1 with the error set. */
static int lock_take(void) {
#if PY_VERSION_HEX < 0x030D0000
    if (S.lock_c) {
        RLockLayout *l = (RLockLayout *)S.lock;
        unsigned long tid = PyThread_get_thread_ident();
        if (l->rlock_count > 0 && l->rlock_owner == tid) {
            if (l->rlock_count + 1 > l->rlock_count) {
                l->rlock_count++;
                return 0;
            }
        } else if (PyThread_acquire_lock_timed(l->rlock_lock, 0, 0) == PY_LOCK_ACQUIRED) {
            l->rlock_owner = tid;
            l->rlock_count = 1;
            return 0;
        } else {
            S.lock_waits++;
        }
    }
#endif
    PyObject *r = PyObject_CallNoArgs(S.lock_acquire);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* engine.lock.release(); -1 with the error set. Keeps an error already set (a failed record). */
static int lock_drop(void) {
#if PY_VERSION_HEX < 0x030D0000
    if (S.lock_c) {
        RLockLayout *l = (RLockLayout *)S.lock;
        if (l->rlock_count > 0 && l->rlock_owner == PyThread_get_thread_ident()) {
            if (--l->rlock_count == 0) {
                l->rlock_owner = 0;
                PyThread_release_lock(l->rlock_lock);
            }
            return 0;
        }
    }
#endif
    PyObject *exc_type, *exc_val, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_val, &exc_tb);
    PyObject *r = PyObject_CallNoArgs(S.lock_release);
    if (r == NULL) {
        Py_XDECREF(exc_type); Py_XDECREF(exc_val); Py_XDECREF(exc_tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(exc_type, exc_val, exc_tb);
    return 0;
}

/* Whether engine.lock's C layout is _thread.RLock's (NOTE [engine lock in C]): its acquire and
   release methods are bound to it, its type has that size and name, and a Python acquire and
   release move the owner and count fields as expected. 0 (the Python calls) otherwise; -1 on
   an error. */
static int lock_layout_ok(void) {
#if PY_VERSION_HEX < 0x030D0000
    if (!PyCFunction_Check(S.lock_acquire) || !PyCFunction_Check(S.lock_release)) return 0;
    PyObject *lock = PyCFunction_GET_SELF(S.lock_acquire);
    if (lock == NULL || lock != PyCFunction_GET_SELF(S.lock_release)) return 0;
    PyTypeObject *t = Py_TYPE(lock);
    if (t->tp_basicsize != (Py_ssize_t)sizeof(RLockLayout) || strcmp(t->tp_name, "_thread.RLock") != 0)
        return 0;
    Py_XSETREF(S.lock, Py_NewRef(lock));
    RLockLayout *l = (RLockLayout *)lock;
    unsigned long tid = PyThread_get_thread_ident(), c0 = l->rlock_count;
    int ok = 1;
    for (int i = 1; i <= 2; i++) {
        PyObject *r = PyObject_CallNoArgs(S.lock_acquire);
        if (r == NULL) return -1;
        Py_DECREF(r);
        ok = ok && l->rlock_owner == tid && l->rlock_count == c0 + i;
    }
    for (int i = 1; i <= 2; i++) {
        PyObject *r = PyObject_CallNoArgs(S.lock_release);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return ok && l->rlock_count == c0 && (c0 > 0 || l->rlock_owner == 0);
#else
    return 0;
#endif
}

/* ts_changed(): engine.local.ts was set (NOTE [thread state memo]) */
static PyObject *ts_changed(PyObject *self, PyObject *unused) {
    S.ts_epoch++;
    Py_RETURN_NONE;
}

static int held_enter(int *main) {
    /* Interrupts.main and .depth at their slots (the layout setup checked for engine.interrupts) */
    PyObject **slot = (PyObject **)((char *)S.held + L_held.off[0]);
    if (*slot == NULL) { PyErr_SetString(PyExc_AttributeError, "main"); return -1; }
    unsigned long mid = PyLong_AsUnsignedLong(*slot);
    if (mid == (unsigned long)-1 && PyErr_Occurred()) return -1;
    *main = PyThread_get_thread_ident() == mid;
    if (!*main) return 0;
    slot = (PyObject **)((char *)S.held + L_held.off[1]);
    if (*slot == NULL) { PyErr_SetString(PyExc_AttributeError, "depth"); return -1; }
    PyObject *d1 = PyNumber_Add(*slot, S.one);
    if (d1 == NULL) return -1;
    Py_SETREF(*slot, d1);
    return 0;
}

/* Leaves one level; at the outermost, calls the handlers of signals that arrived meanwhile.
   Returns -1 when that raised (the error is set). */
static int held_exit(int main, int deliver) {
    if (!main) return 0;
    PyObject *exc_type, *exc_val, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_val, &exc_tb);
    PyObject **slot = (PyObject **)((char *)S.held + L_held.off[1]);
    PyObject *d = *slot;
    int ret = 0;
    if (d != NULL) {
        PyObject *d1 = PyNumber_Subtract(d, S.one);
        if (d1 != NULL) {
            long depth = PyLong_AsLong(d1);
            if (depth == -1 && PyErr_Occurred()) ret = -1;
            Py_SETREF(*slot, d1);
            if (ret == 0 && depth == 0 && deliver) {
                PyObject *h = *(PyObject **)((char *)S.held + L_held.off[2]);   /* .held */
                if (h == NULL) { PyErr_SetString(PyExc_AttributeError, "held"); ret = -1; }
                else {
                    Py_INCREF(h);
                    int any = PyObject_IsTrue(h);
                    Py_DECREF(h);
                    if (any > 0) {
                        PyErr_Restore(exc_type, exc_val, exc_tb);
                        exc_type = exc_val = exc_tb = NULL;
                        if (PyErr_Occurred()) return -1;    /* the op's error goes first */
                        PyObject *r = PyObject_CallMethodNoArgs(S.held, A_deliver);
                        if (r == NULL) return -1;
                        Py_DECREF(r);
                        return 0;
                    }
                    if (any < 0) ret = -1;
                }
            }
        } else ret = -1;
    } else { PyErr_SetString(PyExc_AttributeError, "depth"); ret = -1; }
    if (exc_type != NULL) {
        PyErr_Restore(exc_type, exc_val, exc_tb);
        return -1;
    }
    return ret;
}

/* ------------------------------------------------------------------ __torch_dispatch__ */
static PyObject *miss(PyObject *const *args, Py_ssize_t nargs) {
    S.misses++;
    return PyObject_Vectorcall(S.py_dispatch, args, nargs, NULL);
}

/* tensor.make: a TpuTensor over storage st (sig: its interned signature, never None here) */
static PyObject *make_tensor(PyObject *st, PyObject *chain, PyObject *size, PyObject *stride,
                             PyObject *offset, PyObject *dtype, PyObject *sig) {
    PyObject *d = GET(st, A_device);
    if (d == NULL) return NULL;
    Py_ssize_t di = PyLong_AsSsize_t(d);
    Py_DECREF(d);
    if (di == -1 && PyErr_Occurred()) return NULL;
    PyObject *device = PyList_GetItem(S.devices, di);
    if (device == NULL) return NULL;
    int off = PyObject_IsTrue(offset);
    if (off < 0) return NULL;
    PyObject *wargs[8] = {S.tpu_type, size, stride, off ? offset : Py_None, Py_None, dtype,
                          S.strided, device};
    PyObject *t = PyObject_Vectorcall(S.wrap, wargs, 8, NULL);
    if (t == NULL) return NULL;
    if (PyObject_SetAttr(t, A_s, st) < 0 || PyObject_SetAttr(t, A_chain, chain) < 0 ||
            PyObject_SetAttr(t, A_sig, sig) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

/* One view result from a cached (size, stride, offset, dtype, chain, sig, rel) and the input's
   offset (views.run_view) */
static PyObject *make_view(PyObject *st, PyObject *v, PyObject *off0) {
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 7 || PyTuple_GET_ITEM(v, 5) == Py_None)
        return NOT_FAST;
    PyObject *offset = PyTuple_GET_ITEM(v, 2);
    int rel = PyObject_IsTrue(PyTuple_GET_ITEM(v, 6));
    if (rel < 0) return NULL;
    if (rel) {
        offset = PyNumber_Add(offset, off0);
        if (offset == NULL) return NULL;
    } else {
        Py_INCREF(offset);
    }
    PyObject *t = make_tensor(st, PyTuple_GET_ITEM(v, 4), PyTuple_GET_ITEM(v, 0),
                              PyTuple_GET_ITEM(v, 1), offset, PyTuple_GET_ITEM(v, 3),
                              PyTuple_GET_ITEM(v, 5));
    Py_DECREF(offset);
    return t;
}

static int exact_int(PyObject *o, long long *v) {
    if (Py_TYPE(o) != &PyLong_Type) return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (*v == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    return 1;
}

/* select.int and slice.Tensor as views at a moving offset (views._moving_view), when their
   cached description exists; NOT_FAST otherwise (the Python path decides, raises or caches). */
static PyObject *try_moving(PyObject *func, PyObject *info, PyObject *base, PyObject *args,
                            PyObject *kwargs, PyObject *st, PyObject *sig) {
    int select = func == S.select_op;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) return NOT_FAST;
    PyObject *shape = GET(base, A_shape);
    if (shape == NULL) return NULL;
    if (!PyTuple_Check(shape)) { Py_DECREF(shape); return NOT_FAST; }
    long long nd = PyTuple_GET_SIZE(shape), dim = 0, index, n;
    PyObject *key = NULL, *result = NOT_FAST;
    if (nd == 0) goto done;
    if (select) {
        long long idx;
        if (nargs != 3 || !exact_int(PyTuple_GET_ITEM(args, 1), &dim) ||
                !exact_int(PyTuple_GET_ITEM(args, 2), &idx) || dim < -nd || dim >= nd)
            goto done;
        dim = (dim % nd + nd) % nd;
        if (!exact_int(PyTuple_GET_ITEM(shape, dim), &n)) goto done;
        if (idx < -n || idx >= n) goto done;     /* the meta kernel raises */
        if (n <= 1) { result = GENERIC; goto done; }
        index = idx < 0 ? idx + n : idx;
        key = Py_BuildValue("(OOOL)", info, S.dselect, sig, dim);
    } else {
        long long start = 0, end, step = 1;
        PyObject *a;
        if (nargs > 5) goto done;
        if (nargs > 1 && !exact_int(PyTuple_GET_ITEM(args, 1), &dim)) goto done;
        if (nargs > 4 && !exact_int(PyTuple_GET_ITEM(args, 4), &step)) goto done;
        if (step < 1 || dim < -nd || dim >= nd) goto done;
        dim = (dim % nd + nd) % nd;
        if (!exact_int(PyTuple_GET_ITEM(shape, dim), &n)) goto done;
        end = n;
        if (nargs > 2 && (a = PyTuple_GET_ITEM(args, 2)) != Py_None && !exact_int(a, &start))
            goto done;
        if (nargs > 3 && (a = PyTuple_GET_ITEM(args, 3)) != Py_None && !exact_int(a, &end))
            goto done;
        /* PyTorch's slice bounds: negatives from the end, clamped to [0, n] */
        if (start < 0) start += n;
        if (end < 0) end += n;
        start = start < 0 ? 0 : (start > n ? n : start);
        end = end < start ? start : (end > n ? n : end);
        long long length = (end - start + step - 1) / step;
        if (length == 0 || (start == 0 && end == n)) { result = GENERIC; goto done; }
        index = start;
        key = Py_BuildValue("(OOOLLL)", info, S.dslice, sig, dim, length, step);
    }
    if (key == NULL) { result = NULL; goto done; }
    PyObject *v = cache_get(S.views, key);
    if (v == NULL) { result = NULL; goto done; }
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 6) { Py_DECREF(v); goto done; }
    /* (size, stride, offset per unit, dtype, chain, signature) */
    long long unit, off0;
    PyObject *o0 = PyObject_CallMethodNoArgs(base, A_storage_offset);
    if (o0 == NULL) { Py_DECREF(v); result = NULL; goto done; }
    int ok = exact_int(o0, &off0) && exact_int(PyTuple_GET_ITEM(v, 2), &unit);
    Py_DECREF(o0);
    PyObject *dyn = ok ? tensor_attr(base, A_dyn) : NULL;
    if (dyn == NULL || !PyTuple_Check(dyn)) {
        Py_DECREF(v);
        if (PyErr_Occurred()) result = NULL;
        goto done;
    }
    PyObject *offset = PyLong_FromLongLong(off0 + index * unit);
    PyObject *ix = PyLong_FromLongLong(index);
    PyObject *ndyn = ix ? PyTuple_New(PyTuple_GET_SIZE(dyn) + 1) : NULL;
    if (offset == NULL || ndyn == NULL) {
        Py_XDECREF(offset); Py_XDECREF(ix); Py_XDECREF(ndyn); Py_DECREF(v);
        result = NULL;
        goto done;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(dyn); j++) {
        Py_INCREF(PyTuple_GET_ITEM(dyn, j));
        PyTuple_SET_ITEM(ndyn, j, PyTuple_GET_ITEM(dyn, j));
    }
    PyTuple_SET_ITEM(ndyn, PyTuple_GET_SIZE(dyn), ix);
    result = make_tensor(st, PyTuple_GET_ITEM(v, 4), PyTuple_GET_ITEM(v, 0), PyTuple_GET_ITEM(v, 1),
                         offset, PyTuple_GET_ITEM(v, 3), PyTuple_GET_ITEM(v, 5));
    if (result != NULL && PyObject_SetAttr(result, A_dyn, ndyn) < 0) Py_CLEAR(result);
    Py_DECREF(offset); Py_DECREF(ndyn); Py_DECREF(v);
done:
    Py_DECREF(shape);
    Py_XDECREF(key);
    return result;
}

/* A view op (views.run_view) or detach/alias (views.run_alias) whose results are cached, on a
   tpu tensor that does not move (NOTE [dynamic offsets]); else NOT_FAST. */
static PyObject *try_view(PyObject *func, PyObject *info, PyObject *args, PyObject *kwargs,
                          int alias) {
    PyObject *result = NULL, *key = NULL, *views = NULL;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs < 1) return NOT_FAST;
    PyObject *base = PyTuple_GET_ITEM(args, 0);
    if ((PyObject *)Py_TYPE(base) != S.tpu_type) return NOT_FAST;
    PyObject *inf = PyObject_CallNoArgs(S.inference_on);   /* NOTE [views in inference mode] */
    if (inf == NULL) return NULL;
    int on = inf == Py_True;
    Py_DECREF(inf);
    if (on) return NOT_FAST;
    PyObject *st = tensor_attr(base, A_s), *sig = tensor_attr(base, A_sig),
             *chain = tensor_attr(base, A_chain);
    if (st == NULL || sig == NULL || chain == NULL) return PyErr_Occurred() ? NULL : NOT_FAST;
    int fixed = 0;      /* a select/slice that does not move: the generic path */
    if (func == S.select_op || func == S.slice_op) {   /* a window on an input that may move */
        PyObject *r = try_moving(func, info, base, args, kwargs, st, sig);
        if (r != GENERIC) return r;
        fixed = 1;
    }
    PyObject *dyn = tensor_attr(base, A_dyn);
    if (dyn == NULL) return PyErr_Occurred() ? NULL : NOT_FAST;
    int moves = PyObject_IsTrue(dyn);
    if (moves) return moves < 0 ? NULL : NOT_FAST;

    if (alias) {
        PyObject *m = cache_get(S.aliases, sig);
        if (m == NULL) return NULL;
        if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 3) { Py_DECREF(m); return NOT_FAST; }
        PyObject *dtype = GET(base, A_dtype);
        if (dtype != NULL)
            result = make_tensor(st, chain, PyTuple_GET_ITEM(m, 0), PyTuple_GET_ITEM(m, 1),
                                 PyTuple_GET_ITEM(m, 2), dtype, sig);
        Py_XDECREF(dtype);
        Py_DECREF(m);
        return result;
    }
    for (Py_ssize_t i = 0; !fixed && i < PyTuple_GET_SIZE(S.moving); i++)
        if (PyTuple_GET_ITEM(S.moving, i) == func) return NOT_FAST;
    Py_ssize_t nkw = kwargs != NULL ? PyDict_GET_SIZE(kwargs) : 0;
    key = PyTuple_New(nargs + 1 + (nkw ? 1 : 0));
    if (key == NULL) return NULL;
    Py_INCREF(info); PyTuple_SET_ITEM(key, 0, info);
    Py_INCREF(sig); PyTuple_SET_ITEM(key, 1, sig);
    for (Py_ssize_t i = 1; i < nargs; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i), *e;
        PyTypeObject *ta = Py_TYPE(a);
        if (ta == &PyList_Type) e = PyList_AsTuple(a);
        else if (ta == &PyBool_Type || ta == &PyFloat_Type) e = PyObject_CallOneArg(S.const_fn, a);
        else {
            int ist = PyObject_IsInstance(a, S.tensor_type);
            if (ist) { Py_DECREF(key); return ist < 0 ? NULL : NOT_FAST; }
            e = a; Py_INCREF(e);
        }
        if (e == NULL) goto done;
        PyTuple_SET_ITEM(key, i + 1, e);
    }
    if (nkw) {
        PyObject *kw = PyTuple_New(nkw);
        if (kw == NULL) goto done;
        PyTuple_SET_ITEM(key, nargs + 1, kw);
        Py_ssize_t pos = 0, j = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            PyObject *e = (Py_TYPE(v) == &PyBool_Type || Py_TYPE(v) == &PyFloat_Type)
                          ? PyObject_CallOneArg(S.const_fn, v) : (Py_INCREF(v), v);
            if (e == NULL) goto done;
            PyObject *pair = PyTuple_Pack(2, k, e);
            Py_DECREF(e);
            if (pair == NULL) goto done;
            PyTuple_SET_ITEM(kw, j++, pair);
        }
    }
    views = cache_get(S.views, key);
    if (views == NULL) goto done;
    if (!PyTuple_CheckExact(views) || PyTuple_GET_SIZE(views) != 3) {
        result = NOT_FAST;
        goto done;
    }
    PyObject *made = PyTuple_GET_ITEM(views, 0), *off0 = PyTuple_GET_ITEM(views, 2);
    int multi = PyObject_IsTrue(PyTuple_GET_ITEM(views, 1));
    if (multi < 0 || !PyList_CheckExact(made)) { result = multi < 0 ? NULL : NOT_FAST; goto done; }
    if (multi) {
        Py_ssize_t n = PyList_GET_SIZE(made);
        PyObject *out = PyList_New(n);
        if (out == NULL) goto done;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *t = make_view(st, PyList_GET_ITEM(made, j), off0);
            if (t == NULL || t == NOT_FAST) { Py_DECREF(out); result = t; goto done; }
            PyList_SET_ITEM(out, j, t);
        }
        result = out;
    } else if (PyList_GET_SIZE(made) >= 1) {
        result = make_view(st, PyList_GET_ITEM(made, 0), off0);
    } else {
        result = NOT_FAST;
    }
done:
    Py_XDECREF(key);
    Py_XDECREF(views);
    return result;
}

/* The storage of a tpu tensor (borrowed), or NULL (no error set) when o is something else. */
static PyObject *storage_of(PyObject *o) {
    return (PyObject *)Py_TYPE(o) == S.tpu_type ? tensor_attr(o, A_s) : NULL;
}

/* An in-place foreach op's fast case (specials._h_foreach_inplace and _reads_written decide the
   same): 1 when args[0] is a list of tpu tensors over distinct storages, and no other argument
   reads one of those storages at another index of its list (or as a single tensor); 0 when not
   (the Python path writes one element at a time), -1 on error. */
static int foreach_fast(PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) < 1 || !PyList_CheckExact(PyTuple_GET_ITEM(args, 0))) return 0;
    PyObject *dsts = PyTuple_GET_ITEM(args, 0);
    Py_ssize_t n = PyList_GET_SIZE(dsts);
    PyObject *index = PyDict_New();      /* id(storage) -> its index in dsts */
    if (index == NULL) return -1;
    int result = 1;
    for (Py_ssize_t i = 0; i < n && result == 1; i++) {
        PyObject *st = storage_of(PyList_GET_ITEM(dsts, i));
        if (st == NULL) { result = PyErr_Occurred() ? -1 : 0; break; }
        PyObject *id = PyLong_FromVoidPtr(st), *io = PyLong_FromSsize_t(i);
        int in = id && io ? PyDict_Contains(index, id) : -1;
        if (in == 0 && PyDict_SetItem(index, id, io) < 0) in = -1;
        Py_XDECREF(id); Py_XDECREF(io);
        result = in < 0 ? -1 : !in;
    }
    Py_ssize_t na = PyTuple_GET_SIZE(args), pos = 0;
    PyObject *k, *kv;
    for (Py_ssize_t ai = 1; result == 1; ai++) {
        PyObject *a;
        if (ai < na) a = PyTuple_GET_ITEM(args, ai);
        else if (kwargs != NULL && PyDict_Next(kwargs, &pos, &k, &kv)) a = kv;
        else break;
        PyObject *st = storage_of(a);
        if (st != NULL) {
            PyObject *id = PyLong_FromVoidPtr(st);
            int in = id ? PyDict_Contains(index, id) : -1;
            Py_XDECREF(id);
            result = in < 0 ? -1 : !in;
        } else if (PyErr_Occurred()) {
            result = -1;
        } else if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
            Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
            PyObject **items = PySequence_Fast_ITEMS(a);
            for (Py_ssize_t j = 0; j < m && result == 1; j++) {
                PyObject *sj = storage_of(items[j]);
                if (sj == NULL) { if (PyErr_Occurred()) result = -1; continue; }
                PyObject *id = PyLong_FromVoidPtr(sj);
                PyObject *at = id ? PyDict_GetItemWithError(index, id) : NULL;
                Py_XDECREF(id);
                if (at == NULL) { if (PyErr_Occurred() || id == NULL) result = -1; continue; }
                if (PyLong_AsSsize_t(at) != j) result = 0;
            }
        }
    }
    Py_DECREF(index);
    return result;
}

/* _to_copy's keywords when it stays on its tensor's device and names its dtype (what
   specials._h_to_copy passes to the op: dtype and memory_format, in the call's order); NOT_FAST
   for any other call (another device, a device without an index, pin_memory, layout ...). */
static PyObject *to_copy_kwargs(PyObject *self, PyObject *kwargs) {
    if ((PyObject *)Py_TYPE(self) != S.tpu_type) return NOT_FAST;
    PyObject *dtype = PyDict_GetItemWithError(kwargs, S.dtype_str);
    if (dtype == NULL) return PyErr_Occurred() ? NULL : NOT_FAST;
    if (dtype == Py_None) return NOT_FAST;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) { Py_DECREF(out); return NOT_FAST; }
        /* the names torch passes need not be interned */
        if (k != S.dtype_str && PyUnicode_Compare(k, S.dtype_str) == 0) k = S.dtype_str;
        else if (k != S.memory_format_str && PyUnicode_Compare(k, S.memory_format_str) == 0)
            k = S.memory_format_str;
        else if (k != S.device_str && PyUnicode_Compare(k, S.device_str) == 0) k = S.device_str;
        if (k == S.dtype_str || k == S.memory_format_str) {
            if (PyDict_SetItem(out, k, v) < 0) { Py_DECREF(out); return NULL; }
        } else if (k == S.device_str) {
            PyObject *st = tensor_attr(self, A_s);
            PyObject *d = st ? GET(st, A_device) : NULL;
            if (d == NULL) { Py_DECREF(out); return PyErr_Occurred() ? NULL : NOT_FAST; }
            Py_ssize_t di = PyLong_AsSsize_t(d);
            Py_DECREF(d);
            PyObject *mine = di >= 0 && di < PyList_GET_SIZE(S.devices)
                             ? PyList_GET_ITEM(S.devices, di) : NULL;
            int same = mine ? PyObject_RichCompareBool(v, mine, Py_EQ) : 0;
            if (same != 1) { Py_DECREF(out); return same < 0 ? NULL : NOT_FAST; }
        } else {
            Py_DECREF(out);
            return NOT_FAST;
        }
    }
    return out;
}

/* The fast case, or Py_NotImplemented (nothing changed) when it is not. */
static PyObject *try_fast(PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *result = NULL, *route = NULL, *mode = NULL, *low = NULL, *key = NULL,
             *tensors = NULL, *scalars = NULL, *entry = NULL, *fast = NULL, *dyn = NULL,
             *ins = NULL, *ts = NULL, *tmode = NULL, *trace = NULL, *mut = NULL,
             *own_kwargs = NULL;
    long dev = -1;

    if (kwargs == Py_None) kwargs = NULL;
    if (!PyTuple_CheckExact(args) || (kwargs != NULL && !PyDict_CheckExact(kwargs)))
        goto not_fast;
    PyObject *fid = PyLong_FromVoidPtr(func);
    if (fid == NULL) return NULL;
    route = PyDict_GetItemWithError(S.routes, fid);
    Py_DECREF(fid);
    if (route == NULL) { if (PyErr_Occurred()) return NULL; goto not_fast; }
    Py_INCREF(route);
    if (!PyTuple_CheckExact(route) || PyTuple_GET_SIZE(route) < 2) goto not_fast;
    PyObject *handler = PyTuple_GET_ITEM(route, 0);
    if (handler == S.foreach_fn) {
        /* an in-place foreach op (specials._h_foreach_inplace): the plain op in the common case
           (foreach_fast); else the Python path runs it one element at a time */
        int ok = foreach_fast(args, kwargs);
        if (ok < 0) goto done;
        if (!ok) goto not_fast;
        handler = S.run_fn;
    }
    if (handler == S.to_copy_fn) {
        /* x.to(dtype) on its own device (specials._h_to_copy): the op with the keywords it keeps */
        if (PyTuple_GET_SIZE(args) != 1 || kwargs == NULL) goto not_fast;
        own_kwargs = to_copy_kwargs(PyTuple_GET_ITEM(args, 0), kwargs);
        if (own_kwargs == NULL) goto done;
        if (own_kwargs == NOT_FAST) { own_kwargs = NULL; goto not_fast; }
        kwargs = own_kwargs;
        handler = S.run_fn;
    }
    if (handler != S.run_fn && handler != S.view_fn && handler != S.alias_fn) goto not_fast;
    mode = PyObject_CallOneArg(S.get_mode, S.fake_key);
    if (mode == NULL) goto done;
    if (mode != Py_None) goto not_fast;
    PyObject *info = PyTuple_GET_ITEM(route, 1);
    if (handler != S.run_fn) {
        result = try_view(func, info, args, kwargs, handler == S.alias_fn);
        if (result == NOT_FAST) Py_INCREF(result);
        goto done;
    }
    low = GET(info, A_low);
    if (low == NULL) goto done;
    int rng;
    if (is_true_attr(low, A_rng, &rng) < 0) goto done;
    if (rng) goto not_fast;

    int k = op_key(info, args, kwargs, &key, &tensors, &scalars, &dev);
    if (k < 0) goto done;
    if (k == 0) goto not_fast;
    entry = cache_get(S.ops, key);
    if (entry == NULL) goto done;
    if (entry == Py_None || PyUnicode_Check(entry)) goto not_fast;
    fast = GET(entry, A_fast);
    if (fast == NULL) goto done;
    if (fast == Py_None) {
        /* an op that writes inputs: entry.out[1], the written tensors' indexes */
        PyObject *o = GET(entry, A_out);
        if (o == NULL) goto done;
        if (PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) >= 2 &&
                PyTuple_CheckExact(PyTuple_GET_ITEM(o, 1)) && PyTuple_GET_SIZE(PyTuple_GET_ITEM(o, 1))) {
            mut = PyTuple_GET_ITEM(o, 1);
            Py_INCREF(mut);
        }
        Py_DECREF(o);
        if (mut == NULL) goto not_fast;
    } else if (!(PyTuple_CheckExact(fast) || PyList_CheckExact(fast))) {
        goto not_fast;
    }
    dyn = GET(entry, A_dyn_e);
    if (dyn == NULL) goto done;
    if (!PyTuple_CheckExact(dyn)) goto not_fast;
    /* inputs that are views at dynamic offsets: the offsets are int inputs after the op's own
       scalars (NOTE [dynamic offsets] in runtime/viewchain.py) */
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(dyn); j++) {
        Py_ssize_t ti = PyLong_AsSsize_t(PyTuple_GET_ITEM(dyn, j));
        if (ti < 0 || ti >= PyList_GET_SIZE(tensors)) {
            if (PyErr_Occurred()) goto done;
            goto not_fast;
        }
        PyObject *offs = tensor_attr(PyList_GET_ITEM(tensors, ti), A_dyn);
        if (offs == NULL) { if (PyErr_Occurred()) goto done; goto not_fast; }
        Py_ssize_t ns = PyList_GET_SIZE(scalars);
        if (PyList_SetSlice(scalars, ns, ns, offs) < 0) goto done;
    }

    Py_ssize_t nt = PyList_GET_SIZE(tensors);
    ins = PyList_New(nt);
    if (ins == NULL) goto done;
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *st = tensor_attr(PyList_GET_ITEM(tensors, i), A_s);
        if (st == NULL) { if (!PyErr_Occurred()) goto not_fast; goto done; }
        PyObject *v = GET(st, A_val);
        if (v == NULL) goto done;
        PyList_SET_ITEM(ins, i, v);
    }
    if (mut != NULL) {
        /* a written input overwritten whole, not through a view, is not read */
        int overwrites;
        if (is_true_attr(info, A_overwrites, &overwrites) < 0) goto done;
        for (Py_ssize_t j = 0; overwrites && j < PyTuple_GET_SIZE(mut); j++) {
            Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(mut, j));
            if (m < 0 || m >= nt) { if (PyErr_Occurred()) goto done; goto not_fast; }
            PyObject *chain = tensor_attr(PyList_GET_ITEM(tensors, m), A_chain);
            if (chain == NULL) { if (PyErr_Occurred()) goto done; goto not_fast; }
            int has = PyObject_IsTrue(chain);
            if (has < 0) goto done;
            if (!has) {
                Py_INCREF(Py_None);
                PyList_SetItem(ins, m, Py_None);
            }
        }
    }
    ts = thread_ts();
    if (ts == NULL) goto done;
    tmode = GET(ts, A_mode);
    if (tmode == NULL) goto done;
    int defer = PyObject_RichCompareBool(tmode, S.defer_str, Py_EQ);
    if (defer < 0) goto done;
    if (!defer) goto not_fast;

    if (lock_take() < 0) goto done;
    trace = GET(ts, A_trace);
    if (trace != NULL)
        result = record(trace, entry, fast, ins, scalars, dev, tensors, mut, info, args, kwargs, 0);
    if (lock_drop() < 0) { Py_XDECREF(result); result = NULL; }
    goto done;
not_fast:
    result = Py_NotImplemented;
    Py_INCREF(result);
done:
    Py_XDECREF(route); Py_XDECREF(mode); Py_XDECREF(low); Py_XDECREF(key); Py_XDECREF(tensors);
    Py_XDECREF(scalars); Py_XDECREF(entry); Py_XDECREF(fast); Py_XDECREF(dyn); Py_XDECREF(ins);
    Py_XDECREF(ts); Py_XDECREF(tmode); Py_XDECREF(trace); Py_XDECREF(mut);
    Py_XDECREF(own_kwargs);
    return result;
}

/* dispatch(cls, func, types, args=(), kwargs=None): TpuTensor.__torch_dispatch__ */
static PyObject *dispatch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!S.ready || nargs < 4 || args[0] != S.tpu_type) return miss(args, nargs);
    int on;
    if (is_true_attr(S.config, A_c_record, &on) < 0) return NULL;
    if (!on) return miss(args, nargs);
    int main;
    if (held_enter(&main) < 0) return NULL;
    PyObject *r = try_fast(args[1], args[3], nargs > 4 ? args[4] : NULL);
    if (r == Py_NotImplemented) {
        Py_DECREF(r);
        if (held_exit(main, 0) < 0) return NULL;    /* the Python path holds and delivers */
        return miss(args, nargs);
    }
    if (r != NULL) S.hits++;
    if (held_exit(main, 1) < 0) { Py_XDECREF(r); return NULL; }
    return r;
}

/* record_storages(entry, ins, scalars, dev): NOTE [C++ recording kernel] in _tpu_tensor.cpp. The
   plain tensor's C++ kernel found the op cache's Entry itself (an op whose outputs are new
   tensors: Entry.fast set, no dynamic offsets) and read its inputs' Values and its scalars: this
   records the node as try_fast does (defer mode, no cut due, no input pending in another trace)
   and returns the outputs' new Storages, a tuple; Py_NotImplemented (nothing changed) when it is
   not that case, and the kernel hands the op to the Python router. */
static PyObject *record_storages_checked(PyObject *entry, PyObject *ins, PyObject *scalars,
                                         long dev, PyObject *writes, PyObject *mut, int values);

static PyObject *record_storages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 4 && nargs != 6) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2]) ||
            (nargs == 6 && (!PyList_CheckExact(args[4]) || !PyTuple_CheckExact(args[5]) ||
                            PyList_GET_SIZE(args[4]) != PyTuple_GET_SIZE(args[5])))) {
        PyErr_SetString(PyExc_TypeError, "record_storages(entry, ins: list, scalars: list, dev"
                        "[, written Storages: list, Entry.out[1]: tuple])");
        return NULL;
    }
    /* with the written Storages: an op that writes its inputs (Entry.fast None): each takes its
       new value as dispatch._bind does, and it returns None (the kernel returns the argument) */
    PyObject *writes = nargs == 6 ? args[4] : NULL, *mut = nargs == 6 ? args[5] : NULL;
    if (!S.ready) Py_RETURN_NOTIMPLEMENTED;
    long dev = PyLong_AsLong(args[3]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    PyObject *mode = PyObject_CallOneArg(S.get_mode, S.fake_key);
    if (mode == NULL) return NULL;
    int fake = mode != Py_None;
    Py_DECREF(mode);
    if (fake) Py_RETURN_NOTIMPLEMENTED;
    return record_storages_checked(args[0], args[1], args[2], dev, writes, mut, 0);
}

/* NOTE [C++ node hand-over]: record_storages without its Python call: the plain tensor's C++
   kernel calls this through the capsule `_fastpath.record_capi` (RecordCapi), with the lists it
   built (ins and scalars become the Node's, so they are fresh lists) and the device as a C long,
   after checking itself, in C++, that no fake mode is active (c10's TorchDispatchModeTLS, which
   torch._C._get_dispatch_mode reads: the same answer without a Python call, about half a
   microsecond of record_storages' time). Everything else is record_storages' body: the same
   checks, node, hashes and Storages. With `values` (NOTE [lazy storages] in _tpu_tensor.cpp),
   the output Values instead of Storages: no Storage, weak reference or `storages` entry is made. */
static PyObject *record_storages_checked(PyObject *entry, PyObject *ins, PyObject *scalars,
                                         long dev, PyObject *writes, PyObject *mut, int values) {
    HT_START();
    if (!S.ready) Py_RETURN_NOTIMPLEMENTED;
    PyObject *on_o = config_get(A_c_record);
    int on = on_o == NULL ? -1 : PyObject_IsTrue(on_o);
    if (on < 0) return NULL;
    if (!on) Py_RETURN_NOTIMPLEMENTED;
    PyObject *fast = slot_get(&L_entry, 0, entry, A_fast);
    if (fast == NULL) return NULL;
    if (writes != NULL ? (fast != Py_None || PyTuple_GET_SIZE(mut) == 0)
                       : !(PyTuple_CheckExact(fast) || PyList_CheckExact(fast))) {
        Py_DECREF(fast);
        Py_RETURN_NOTIMPLEMENTED;
    }
    int main;
    HT_MARK(R_ENTRY);
    if (held_enter(&main) < 0) { Py_DECREF(fast); return NULL; }
    HT_MARK(R_HELD);
    PyObject *result = NULL, *ts = NULL, *tmode = NULL, *trace = NULL;
    ts = thread_ts();
    if (ts == NULL) goto done;
    tmode = slot_get(&L_ts, 0, ts, A_mode);
    if (tmode == NULL) goto done;
    int defer = PyObject_RichCompareBool(tmode, S.defer_str, Py_EQ);
    if (defer < 0) goto done;
    if (!defer) { result = Py_NotImplemented; Py_INCREF(result); goto done; }
    HT_MARK(R_TS);
    if (lock_take() < 0) goto done;
    HT_MARK(R_LOCK);
    trace = slot_get(&L_ts, 1, ts, A_trace);
    HT_MARK(R_TRACE);
    if (trace != NULL)
        result = record(trace, entry, fast, ins, scalars, dev, writes, mut, NULL, NULL, NULL,
                        values ? 2 : 1);
    if (lock_drop() < 0) { Py_XDECREF(result); result = NULL; goto done; }
    HT_MARK(R_UNLOCK);
done:
    Py_DECREF(fast); Py_XDECREF(ts); Py_XDECREF(tmode); Py_XDECREF(trace);
    int taken = result != NULL && result != Py_NotImplemented;
    if (taken) S.hits++;
    if (held_exit(main, taken) < 0) { Py_XDECREF(result); return NULL; }
    HT_MARK(R_EXIT);
    HT_ROW(taken);
    return result;
}

static PyObject *setup(PyObject *self, PyObject *kw) {
    if (!PyDict_Check(kw)) { PyErr_SetString(PyExc_TypeError, "setup(dict)"); return NULL; }
#define F(field, name) { PyObject *v = PyDict_GetItemString(kw, name); \
    if (v == NULL) { PyErr_Format(PyExc_KeyError, "setup: %s missing", name); return NULL; } \
    Py_INCREF(v); Py_XSETREF(S.field, v); }
    F(tpu_type, "TpuTensor") F(py_dispatch, "py_dispatch") F(routes, "routes") F(run_fn, "run")
    F(get_mode, "get_mode") F(fake_key, "fake_key") F(held, "interrupts") F(local, "local")
    F(lock_acquire, "lock_acquire") F(lock_release, "lock_release") F(ops, "ops")
    F(ts_tag, "TS") F(ss_tag, "SS") F(special, "special_scalars") F(const_fn, "const")
    F(value_type, "Value") F(node_type, "Node") F(storage_type, "Storage") F(wrap, "wrap")
    F(strided, "strided") F(devices, "devices") F(config, "config") F(sources, "sources")
    F(view_fn, "view") F(alias_fn, "alias") F(foreach_fn, "foreach") F(to_copy_fn, "to_copy")
    F(views, "views") F(aliases, "aliases")
    F(moving, "moving") F(inference_on, "inference_on") F(tensor_type, "Tensor")
    F(select_op, "select") F(slice_op, "slice") F(dselect, "DSELECT") F(dslice, "DSLICE")
    F(dtype_type, "dtype_type") F(memory_format_type, "memory_format_type") F(layout_type, "layout_type")
    F(ts_type, "ThreadState") F(entry_type, "Entry")
#undef F
    if (!PyAnySet_Check(S.special) || !PyList_Check(S.devices)) {
        PyErr_SetString(PyExc_TypeError, "setup: special_scalars must be a set, devices a list");
        return NULL;
    }
    for (int i = 0; i < 64; i++) {
        PyObject *n = PyLong_FromLong(i);
        if (n == NULL) return NULL;
        Py_XSETREF(S.ts_pairs[i], PyTuple_Pack(2, S.ts_tag, n));
        Py_DECREF(n);
        if (S.ts_pairs[i] == NULL) return NULL;
    }
    if (layout_of(&L_value, S.value_type, VALUE_SLOTS, 8) < 0 ||
            layout_of(&L_node, S.node_type, NODE_SLOTS, 9) < 0 ||
            layout_of(&L_storage, S.storage_type, STORAGE_SLOTS, 7) < 0 ||
            slot_offsets(&L_held, (PyObject *)Py_TYPE(S.held), HELD_SLOTS, 3) < 0 ||
            slot_offsets(&L_ts, S.ts_type, TS_SLOTS, 2) < 0 ||
            slot_offsets(&L_entry, S.entry_type, ENTRY_SLOTS, 4) < 0)
        return NULL;
    /* NOTE [source-line memo]: engine.sources.codes, whose young generation names the entries */
    Py_XSETREF(S.source_codes, PyObject_GetAttr(S.sources, A_codes));
    if (S.source_codes == NULL ||
            slot_offsets(&L_cache, (PyObject *)Py_TYPE(S.source_codes), CACHE_SLOTS, 1) < 0)
        return NULL;
    Py_XSETREF(S.config_dict, PyObject_GetAttrString(S.config, "__dict__"));
    if (S.config_dict == NULL) return NULL;
    if (!PyDict_CheckExact(S.config_dict)) {
        PyErr_SetString(PyExc_TypeError, "setup: config.__dict__ must be a dict");
        return NULL;
    }
    if (check_own_hash() < 0) return NULL;      /* NOTE [rolling hashes in C] */
    S.ts_epoch++;                               /* NOTE [thread state memo]: another engine.local */
    S.lock_c = 0;
    int lock_ok = lock_layout_ok();             /* NOTE [engine lock in C] */
    if (lock_ok < 0) return NULL;
    S.lock_c = lock_ok;
    S.ready = 1;
    Py_RETURN_NONE;
}

static PyObject *stats(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{sKsKsKsKsKsKsKsi}", "hits", S.hits, "misses", S.misses,
                         "source_memo_hits", S.src_memo_hits, "source_memo_misses", S.src_memo_misses,
                         "ts_memo_hits", S.ts_memo_hits, "ts_memo_misses", S.ts_memo_misses,
                         "lock_waits", S.lock_waits, "lock_in_c", S.lock_c);
}

static PyObject *reset_stats(PyObject *self, PyObject *unused) {
    S.hits = S.misses = S.src_memo_hits = S.src_memo_misses = 0;
    S.ts_memo_hits = S.ts_memo_misses = S.lock_waits = 0;
    Py_RETURN_NONE;
}

#ifdef DEFERFUSE_HIT_TIMING
/* NOTE [hit timing]: (section names, rows as bytes of uint32 ticks, one row per hit); clears */
static PyObject *hit_timing(PyObject *self, PyObject *unused) {
    PyObject *names = PyTuple_New(R_N);
    if (names == NULL) return NULL;
    for (int i = 0; i < R_N; i++) {
        PyObject *s = PyUnicode_FromString(R_NAMES[i]);
        if (s == NULL) { Py_DECREF(names); return NULL; }
        PyTuple_SET_ITEM(names, i, s);
    }
    PyObject *b = PyBytes_FromStringAndSize(ht_rows ? (const char *)ht_rows : "",
                                            ht_rows ? ht_n * (Py_ssize_t)sizeof *ht_rows : 0);
    ht_n = 0;
    PyObject *r = b ? PyTuple_Pack(2, names, b) : NULL;
    Py_DECREF(names); Py_XDECREF(b);
    return r;
}
#endif

/* NOTE [region hits] (runtime/flush.py): whether a flushed trace's nodes have the structure a
   region hit stands for: node i's op entry equals entries[i] and its wiring equals wirings[i],
   what [n.key for n in nodes] == entries and [n.wiring for n in nodes] == wirings say, without
   making the two lists (NOTE [verified hits]). */
static PyObject *same_structure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *key_s, *wiring_s;
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "same_structure(nodes, entries, wirings) takes three lists");
        return NULL;
    }
    if (key_s == NULL && (key_s = PyUnicode_InternFromString("key")) == NULL) return NULL;
    if (wiring_s == NULL && (wiring_s = PyUnicode_InternFromString("wiring")) == NULL) return NULL;
    PyObject *nodes = args[0], *entries = args[1], *wirings = args[2];
    if (PyList_GET_SIZE(entries) != PyList_GET_SIZE(nodes) ||
        PyList_GET_SIZE(wirings) != PyList_GET_SIZE(nodes))
        Py_RETURN_FALSE;
    /* sizes read again at every step: an __eq__ may change a list (as list's own compare does) */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes) && i < PyList_GET_SIZE(entries) &&
                           i < PyList_GET_SIZE(wirings); i++) {
        PyObject *nd = PyList_GET_ITEM(nodes, i);
        Py_INCREF(nd);
        for (int k = 0; k < 2; k++) {
            PyObject *mine = slot_get(&L_node, k ? 2 : 0, nd, k ? wiring_s : key_s);
            if (mine == NULL) { Py_DECREF(nd); return NULL; }
            PyObject *want = PyList_GET_ITEM(k ? wirings : entries, i);
            Py_INCREF(want);
            int same = PyObject_RichCompareBool(mine, want, Py_EQ);
            Py_DECREF(mine); Py_DECREF(want);
            if (same != 1) {
                Py_DECREF(nd);
                if (same < 0) return NULL;
                Py_RETURN_FALSE;
            }
        }
        Py_DECREF(nd);
    }
    if (PyList_GET_SIZE(entries) != PyList_GET_SIZE(nodes) ||
        PyList_GET_SIZE(wirings) != PyList_GET_SIZE(nodes))
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* NOTE [trace outputs] (deferfuse/record.py, Trace.take): the pending values of trace that a live
   storage of storages (weak references) holds, each once, in trace order (by node position, then
   output index: NOTE [outputs in trace order]), and partner: id(value) -> the storage's prev for
   the first storage (in storages' order) holding each, where prev is not 0; want (or None): the
   value the sync reads, an output too when it is pending in trace; lazy (a list, optional): more
   values held without a Storage (NOTE [lazy storages] in _tpu_tensor.cpp), outputs too when
   pending in trace, with no partner. What Trace.take's walk did in Python, one storage at a time
   without Python frames: most of a hit sync's take. */
typedef struct { Py_ssize_t pos, idx, order; PyObject *v, *prev; } OutRow;

static int out_cmp(const void *a, const void *b) {
    const OutRow *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    if (x->idx != y->idx) return x->idx < y->idx ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* v's (pos, idx) when it is pending in trace: 1; 0 when not; -1 with an error set */
static int pending_in(PyObject *v, PyObject *trace, Py_ssize_t *pos, Py_ssize_t *idx) {
    static PyObject *node_s, *trace_s, *pos_s, *idx_s;
    if (node_s == NULL && ((node_s = PyUnicode_InternFromString("node")) == NULL ||
            (trace_s = PyUnicode_InternFromString("trace")) == NULL ||
            (pos_s = PyUnicode_InternFromString("pos")) == NULL ||
            (idx_s = PyUnicode_InternFromString("idx")) == NULL))
        return -1;
    PyObject *n = slot_get(&L_value, 1, v, node_s);
    if (n == NULL) return -1;
    if (n == Py_None) { Py_DECREF(n); return 0; }
    PyObject *t = Py_IS_TYPE(n, L_node.type) ? slot_get(&L_node, 8, n, trace_s) : GET(n, trace_s);
    if (t == NULL) { Py_DECREF(n); return -1; }
    int mine = t == trace;
    Py_DECREF(t);
    if (mine) {
        PyObject *p = Py_IS_TYPE(n, L_node.type) ? slot_get(&L_node, 7, n, pos_s) : GET(n, pos_s);
        PyObject *i = p ? slot_get(&L_value, 2, v, idx_s) : NULL;
        *pos = p ? PyLong_AsSsize_t(p) : -1;
        *idx = i ? PyLong_AsSsize_t(i) : -1;
        Py_XDECREF(p); Py_XDECREF(i);
        if (PyErr_Occurred()) { Py_DECREF(n); return -1; }
    }
    Py_DECREF(n);
    return mine;
}

static PyObject *trace_outputs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *val_s, *prev_s;
    if ((nargs != 3 && nargs != 4) || !PyList_Check(args[0]) ||
            (nargs == 4 && args[3] != Py_None && !PyList_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "trace_outputs(storages: list, trace, want, lazy=None)");
        return NULL;
    }
    if (val_s == NULL && ((val_s = PyUnicode_InternFromString("val")) == NULL ||
                          (prev_s = PyUnicode_InternFromString("prev")) == NULL))
        return NULL;
    PyObject *storages = args[0], *trace = args[1], *want = args[2];
    PyObject *lazy = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    Py_ssize_t n = PyList_GET_SIZE(storages), k = 0;
    Py_ssize_t nl = lazy ? PyList_GET_SIZE(lazy) : 0;
    OutRow *rows = PyMem_Malloc((n + nl + 1) * sizeof *rows);
    if (rows == NULL) return PyErr_NoMemory();
    PyObject *outs = NULL, *partner = NULL, *result = NULL;
    for (Py_ssize_t j = 0; j < n && j < PyList_GET_SIZE(storages); j++) {
        PyObject *r = PyList_GET_ITEM(storages, j);
        if (!PyWeakref_Check(r)) { PyErr_SetString(PyExc_TypeError, "trace_outputs: not a weakref"); goto done; }
        PyObject *st = PyWeakref_GetObject(r);      /* borrowed */
        if (st == Py_None) continue;
        Py_INCREF(st);
        PyObject *v = slot_get(&L_storage, 0, st, val_s);
        if (v == NULL) { Py_DECREF(st); goto done; }
        Py_ssize_t pos, idx;
        int mine = pending_in(v, trace, &pos, &idx);
        if (mine <= 0) { Py_DECREF(v); Py_DECREF(st); if (mine < 0) goto done; continue; }
        PyObject *prev = slot_get(&L_storage, 6, st, prev_s);
        Py_DECREF(st);
        if (prev == NULL) { Py_DECREF(v); goto done; }
        rows[k++] = (OutRow){pos, idx, j, v, prev};        /* owns v and prev */
    }
    /* the lazy values after every storage's, then the value the sync reads: no partner */
    for (Py_ssize_t j = 0; j <= nl; j++) {
        PyObject *v = j < nl ? (j < PyList_GET_SIZE(lazy) ? PyList_GET_ITEM(lazy, j) : Py_None)
                             : want;
        if (v == Py_None) continue;
        Py_ssize_t pos, idx;
        int mine = pending_in(v, trace, &pos, &idx);
        if (mine < 0) goto done;
        if (mine) {
            Py_INCREF(v); Py_INCREF(Py_False);
            rows[k++] = (OutRow){pos, idx, n + j, v, Py_False};
        }
    }
    qsort(rows, k, sizeof *rows, out_cmp);
    if ((outs = PyList_New(0)) == NULL || (partner = PyDict_New()) == NULL) goto done;
    Py_ssize_t group = 0;       /* where the rows of this (pos, idx) begin in outs */
    for (Py_ssize_t j = 0; j < k; j++) {
        /* a value's rows share its (pos, idx), the first storage's first: keep that one */
        if (j == 0 || rows[j].pos != rows[j - 1].pos || rows[j].idx != rows[j - 1].idx)
            group = PyList_GET_SIZE(outs);
        PyObject *last = rows[j].v;
        int dup = 0;
        for (Py_ssize_t q = group; q < PyList_GET_SIZE(outs) && !dup; q++)
            dup = PyList_GET_ITEM(outs, q) == last;
        if (dup) continue;
        if (PyList_Append(outs, last) < 0) goto done;
        int t = PyObject_IsTrue(rows[j].prev);
        if (t < 0) goto done;
        if (t) {
            PyObject *key = PyLong_FromVoidPtr(last);
            if (key == NULL || PyDict_SetItem(partner, key, rows[j].prev) < 0) { Py_XDECREF(key); goto done; }
            Py_DECREF(key);
        }
    }
    result = PyTuple_Pack(2, outs, partner);
done:
    for (Py_ssize_t j = 0; j < k; j++) { Py_DECREF(rows[j].v); Py_DECREF(rows[j].prev); }
    PyMem_Free(rows);
    Py_XDECREF(outs); Py_XDECREF(partner);
    return result;
}

/* NOTE [run tables in C] (runtime/checks.py, runtime/flush.py's Runner.bind): what a region's run
   does per value after its call, written out in Python once per value and hit sync: the donated
   inputs made failed (drop_values), the outputs bound (bind_values), the unchecked inputs' records
   (unchecked_inputs) and the index-check record's tables (check_tables). Each does exactly what
   the Python version beside it does (the tests compare them), one value at a time in C; a value
   not of the exact Value class goes through its attributes (or its fail method). */
static int slot_put(Layout *L, int k, PyObject *o, PyObject *name, PyObject *val) {
    if (Py_IS_TYPE(o, L->type)) {
        PyObject **p = (PyObject **)((char *)o + L->off[k]);
        PyObject *old = *p;
        Py_INCREF(val);
        *p = val;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(o, name, val);
}

static PyObject *run_names[6];      /* array, node, nbytes, err, chk, done */

static int run_names_ok(void) {
    static const char *const s[] = {"array", "node", "nbytes", "err", "chk", "done"};
    if (run_names[5] != NULL) return 0;
    for (int i = 0; i < 6; i++)
        if (run_names[i] == NULL && (run_names[i] = PyUnicode_InternFromString(s[i])) == NULL)
            return -1;
    return 0;
}

/* v.nbytes as a long long (-1 with an error set) */
static long long value_nbytes(PyObject *v) {
    PyObject *b = slot_get(&L_value, 5, v, run_names[2]);
    if (b == NULL) return -1;
    long long n = PyLong_AsLongLong(b);
    Py_DECREF(b);
    return n;
}

/* NOTE [lazy cuts] (runtime/buckets.py): a lazily cut value's array is a records.Padded, counted
   at the padded array's size (its own nbytes), not the value's; set by value_finalizer. */
static PyTypeObject *padded_type;

static long long array_nbytes(PyObject *v, PyObject *a) {
    if (padded_type != NULL && Py_IS_TYPE(a, padded_type)) {
        PyObject *b = PyObject_GetAttrString(a, "nbytes");
        if (b == NULL) return -1;
        long long n = PyLong_AsLongLong(b);
        Py_DECREF(b);
        return n;
    }
    return value_nbytes(v);
}

/* bind_values(values, arrays, large) -> (bytes, n, large bytes, large n): for each pair (as zip),
   v.array = a and v.node = None; the sums are what memory's Counters.add counts them as. */
static PyObject *bind_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "bind_values(values, arrays, large)"); return NULL; }
    if (run_names_ok() < 0) return NULL;
    long long large = PyLong_AsLongLong(args[2]);
    if (large == -1 && PyErr_Occurred()) return NULL;
    PyObject *vs = PySequence_Fast(args[0], "bind_values: values"), *as = NULL;
    if (vs == NULL || (as = PySequence_Fast(args[1], "bind_values: arrays")) == NULL) { Py_XDECREF(vs); return NULL; }
    long long n = 0, k = 0, big = 0, nbig = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(vs) && i < PySequence_Fast_GET_SIZE(as); i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(vs, i), *a = PySequence_Fast_GET_ITEM(as, i);
        Py_INCREF(v); Py_INCREF(a);
        int bad = slot_put(&L_value, 0, v, run_names[0], a) < 0 ||
                  slot_put(&L_value, 1, v, run_names[1], Py_None) < 0;
        long long b = bad ? -1 : array_nbytes(v, a);
        Py_DECREF(v); Py_DECREF(a);
        if (bad || (b == -1 && PyErr_Occurred())) goto done;
        n += b; k++;
        if (b > large) { big += b; nbig++; }
    }
    result = Py_BuildValue("(LLLL)", n, k, big, nbig);
done:
    Py_DECREF(vs); Py_DECREF(as);
    return result;
}

/* drop_values(values, flags, err, large) -> (bytes, n, large bytes, large n), negative: for each pair
   (as zip) whose flag is true and whose value has an array, what Value.fail(err) does (array and
   node None, err set); the sums un-count the arrays dropped (memory's Counters.add). A value not
   of the exact class runs its own fail (which counts itself). */
static PyObject *drop_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "drop_values(values, flags, err, large)"); return NULL; }
    if (run_names_ok() < 0) return NULL;
    long long large = PyLong_AsLongLong(args[3]);
    if (large == -1 && PyErr_Occurred()) return NULL;
    PyObject *err = args[2];
    PyObject *vs = PySequence_Fast(args[0], "drop_values: values"), *fs = NULL;
    if (vs == NULL || (fs = PySequence_Fast(args[1], "drop_values: flags")) == NULL) { Py_XDECREF(vs); return NULL; }
    long long n = 0, k = 0, big = 0, nbig = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(vs) && i < PySequence_Fast_GET_SIZE(fs); i++) {
        int d = PyObject_IsTrue(PySequence_Fast_GET_ITEM(fs, i));
        if (d < 0) goto done;
        if (!d) continue;
        PyObject *v = PySequence_Fast_GET_ITEM(vs, i);
        Py_INCREF(v);
        PyObject *a = slot_get(&L_value, 0, v, run_names[0]);
        if (a == NULL) { Py_DECREF(v); goto done; }
        int has = a != Py_None;
        int bad = 0;
        if (has && !Py_IS_TYPE(v, L_value.type)) {
            PyObject *r = PyObject_CallMethod(v, "fail", "O", err);
            bad = r == NULL;
            Py_XDECREF(r);
        } else if (has) {
            long long b = array_nbytes(v, a);
            bad = (b == -1 && PyErr_Occurred()) ||
                  slot_put(&L_value, 0, v, run_names[0], Py_None) < 0 ||
                  slot_put(&L_value, 1, v, run_names[1], Py_None) < 0 ||
                  slot_put(&L_value, 6, v, run_names[3], err) < 0;
            if (!bad) {
                n -= b; k--;
                if (b > large) { big -= b; nbig--; }
            }
        }
        Py_DECREF(a);
        Py_DECREF(v);
        if (bad) goto done;
    }
    result = Py_BuildValue("(LLLL)", n, k, big, nbig);
done:
    Py_DECREF(vs); Py_DECREF(fs);
    return result;
}

/* unchecked_inputs(ext) -> [(i, c, c.at[id(v)]) for each ext[i] = v whose c = v.chk is a record
   not read yet (not c.done)], or None when there is none (NOTE [unchecked values]). Inputs from one
   run share its record: its done and at are read once for a stretch of them. */
static PyObject *unchecked_inputs(PyObject *self, PyObject *ext) {
    static PyObject *at_s;
    if (run_names_ok() < 0) return NULL;
    if (at_s == NULL && (at_s = PyUnicode_InternFromString("at")) == NULL) return NULL;
    PyObject *vs = PySequence_Fast(ext, "unchecked_inputs: ext");
    if (vs == NULL) return NULL;
    PyObject *ups = NULL, *last = NULL, *last_at = NULL;   /* last: the record last read (owned) */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(vs); i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(vs, i);
        Py_INCREF(v);
        PyObject *c = slot_get(&L_value, 7, v, run_names[4]);
        if (c == NULL) { Py_DECREF(v); goto bad; }
        if (c != last) {
            if (c == Py_None) { Py_DECREF(c); Py_DECREF(v); continue; }
            Py_CLEAR(last_at);
            Py_XSETREF(last, c);
            Py_INCREF(c);
            PyObject *done = PyObject_GetAttr(c, run_names[5]);
            int t = done == NULL ? -1 : PyObject_IsTrue(done);
            Py_XDECREF(done);
            if (t < 0) { Py_DECREF(c); Py_DECREF(v); goto bad; }
            /* last_at stays NULL for a record read already */
            if (!t && (last_at = PyObject_GetAttr(c, at_s)) == NULL) { Py_DECREF(c); Py_DECREF(v); goto bad; }
        }
        if (last_at == NULL) { Py_DECREF(c); Py_DECREF(v); continue; }
        PyObject *key = PyLong_FromVoidPtr(v), *pos = NULL;
        Py_DECREF(v);
        if (key != NULL) pos = PyObject_GetItem(last_at, key);
        Py_XDECREF(key);
        PyObject *row = pos == NULL ? NULL : PyTuple_New(3), *ix = row ? PyLong_FromSsize_t(i) : NULL;
        if (ix == NULL) { Py_DECREF(c); Py_XDECREF(pos); Py_XDECREF(row); goto bad; }
        PyTuple_SET_ITEM(row, 0, ix);
        PyTuple_SET_ITEM(row, 1, c);        /* steals c and pos */
        PyTuple_SET_ITEM(row, 2, pos);
        if (ups == NULL && (ups = PyList_New(0)) == NULL) { Py_DECREF(row); goto bad; }
        int r = PyList_Append(ups, row);
        Py_DECREF(row);
        if (r < 0) goto bad;
    }
    Py_DECREF(vs); Py_XDECREF(last); Py_XDECREF(last_at);
    if (ups == NULL) Py_RETURN_NONE;
    return ups;
bad:
    Py_DECREF(vs); Py_XDECREF(ups); Py_XDECREF(last); Py_XDECREF(last_at);
    return NULL;
}

/* check_tables(outs, rec) -> (refs, at): a weak reference to each value and id(value) -> its
   position (a later one of the same value wins), and each value's chk set to rec: the tables of
   an index-check record (runtime/checks.py's Checks.outs and .at). */
static PyObject *check_tables(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "check_tables(outs, rec)"); return NULL; }
    if (run_names_ok() < 0) return NULL;
    PyObject *vs = PySequence_Fast(args[0], "check_tables: outs"), *rec = args[1];
    if (vs == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(vs);
    PyObject *refs = PyList_New(n), *at = PyDict_New(), *result = NULL;
    if (refs == NULL || at == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(vs)) {
            PyErr_SetString(PyExc_RuntimeError, "check_tables: outs changed size");
            goto done;
        }
        PyObject *v = PySequence_Fast_GET_ITEM(vs, i);
        Py_INCREF(v);
        PyObject *r = PyWeakref_NewRef(v, NULL), *key = r ? PyLong_FromVoidPtr(v) : NULL;
        PyObject *pos = key ? PyLong_FromSsize_t(i) : NULL;
        int bad = pos == NULL || PyDict_SetItem(at, key, pos) < 0;
        Py_XDECREF(key); Py_XDECREF(pos);
        if (r != NULL) PyList_SET_ITEM(refs, i, r);     /* steals r */
        if (!bad) bad = slot_put(&L_value, 7, v, run_names[4], rec) < 0;
        Py_DECREF(v);
        if (bad) goto done;
    }
    result = PyTuple_Pack(2, refs, at);
done:
    Py_DECREF(vs); Py_XDECREF(refs); Py_XDECREF(at);
    return result;
}

/* NOTE [value finalizer]: Value.__del__ (scheduler/records.py) un-counts a freed value's array in
   the memory counters; as a Python method it ran for every Value freed (a hit sync frees every
   value its trace made but did not keep: ~90 ns each, two thirds of freeing one). The same in C,
   installed as the exact class's tp_finalize (value_finalizer(records._account)); a subclass keeps
   the Python method (its slots are filled from __del__ when the class is made), and so does Value
   itself until this is installed, or if __del__ is ever set again. */
static PyObject *value_account;     /* records._account: [the counting function] */

static void value_finalize(PyObject *self) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *a, *nb = NULL;
    if (Py_IS_TYPE(self, L_value.type)) {
        a = *(PyObject **)((char *)self + L_value.off[0]);
        Py_XINCREF(a);
        if (a == NULL) PyErr_SetString(PyExc_AttributeError, "array");
    } else {
        a = PyObject_GetAttrString(self, "array");
    }
    if (a != NULL && a != Py_None) {
        int pad = padded_type != NULL && Py_IS_TYPE(a, padded_type);   /* counted at its size */
        nb = Py_IS_TYPE(self, L_value.type) && !pad
             ? *(PyObject **)((char *)self + L_value.off[5]) : NULL;
        if (nb != NULL) Py_INCREF(nb);
        else nb = PyObject_GetAttrString(pad ? a : self, "nbytes");
        PyObject *f = nb ? PyList_GetItem(value_account, 0) : NULL;     /* borrowed */
        PyObject *minus = f ? PyLong_FromLong(-1) : NULL;
        PyObject *r = minus ? PyObject_CallFunctionObjArgs(f, nb, minus, NULL) : NULL;
        Py_XDECREF(minus);
        if (r != NULL) Py_DECREF(r);
        else if (PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_Clear();   /* interpreter shutdown */
    }
    Py_XDECREF(a); Py_XDECREF(nb);
    if (PyErr_Occurred()) PyErr_WriteUnraisable(self);
    PyErr_Restore(et, ev, tb);
}

static PyObject *value_finalizer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *account = nargs == 2 ? args[0] : NULL;
    if (L_value.type == NULL || account == NULL || !PyList_Check(account) ||
            PyList_GET_SIZE(account) != 1 || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "value_finalizer(records._account, records.Padded) after setup");
        return NULL;
    }
    Py_INCREF(account);
    Py_XSETREF(value_account, account);
    Py_INCREF(args[1]);
    Py_XSETREF(padded_type, (PyTypeObject *)args[1]);
    L_value.type->tp_finalize = value_finalize;
    Py_RETURN_NONE;
}

/* NOTE [hit key parts] (runtime/hits.py's hit_parts): the two per-value parts of a flush's HitKey,
   (held, out_sig): held[i] whether something beyond the ext list and the trace's own ext_uses[i]
   node inputs holds ext[i] (NOTE [donation safety]: Python's sys.getrefcount(ext[i]) - 2 -
   ext_uses[i] > 0, whose 2 are the list and getrefcount's argument; here the list's alone, the
   value being borrowed), and out_sig[j] = (outs[j].node.pos, outs[j].idx). Two Python loops of a
   bound check, a call and a tuple per value on every sync, before the call; here one pass each. */
static PyObject *hit_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *node_s, *pos_s, *idx_s;
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "hit_parts(ext, ext_uses, outs) takes three lists");
        return NULL;
    }
    if (node_s == NULL && ((node_s = PyUnicode_InternFromString("node")) == NULL ||
            (pos_s = PyUnicode_InternFromString("pos")) == NULL ||
            (idx_s = PyUnicode_InternFromString("idx")) == NULL))
        return NULL;
    PyObject *ext = args[0], *uses = args[1], *outs = args[2];
    Py_ssize_t n = PyList_GET_SIZE(ext), m = PyList_GET_SIZE(outs);
    PyObject *held = PyTuple_New(n), *sig = NULL, *result = NULL;
    if (held == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(ext) || i >= PyList_GET_SIZE(uses)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        Py_ssize_t u = PyLong_AsSsize_t(PyList_GET_ITEM(uses, i));
        if (u == -1 && PyErr_Occurred()) goto done;
        PyObject *b = Py_REFCNT(PyList_GET_ITEM(ext, i)) - 1 - u > 0 ? Py_True : Py_False;
        Py_INCREF(b);
        PyTuple_SET_ITEM(held, i, b);
    }
    if ((sig = PyTuple_New(m)) == NULL) goto done;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (j >= PyList_GET_SIZE(outs)) {
            PyErr_SetString(PyExc_RuntimeError, "hit_parts: outs changed size");
            goto done;
        }
        PyObject *v = PyList_GET_ITEM(outs, j);
        Py_INCREF(v);
        PyObject *nd = slot_get(&L_value, 1, v, node_s);
        PyObject *p = nd == NULL ? NULL : Py_IS_TYPE(nd, L_node.type) ? slot_get(&L_node, 7, nd, pos_s)
                                                                      : GET(nd, pos_s);
        PyObject *i = p == NULL ? NULL : slot_get(&L_value, 2, v, idx_s);
        Py_DECREF(v); Py_XDECREF(nd);
        PyObject *pair = i == NULL ? NULL : PyTuple_New(2);
        if (pair == NULL) { Py_XDECREF(p); Py_XDECREF(i); goto done; }
        PyTuple_SET_ITEM(pair, 0, p);
        PyTuple_SET_ITEM(pair, 1, i);
        PyTuple_SET_ITEM(sig, j, pair);
    }
    result = PyTuple_Pack(2, held, sig);
done:
    Py_DECREF(held); Py_XDECREF(sig);
    return result;
}

static PyMethodDef methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL,
     "TpuTensor.__torch_dispatch__: the C record path's fast case, else the Python path."},
    {"record_storages", (PyCFunction)(void (*)(void))record_storages, METH_FASTCALL,
     "The plain tensor's C++ kernel: record one cached op, return its outputs' Storages."},
    {"setup", setup, METH_O, "Hand over the engine's objects (deferfuse/route.py)."},
    {"set_own_hash", set_own_hash, METH_O,
     "NOTE [rolling hashes in C]: hash the trace's tuples from their items (on) or pack them."},
    {"stats", stats, METH_NOARGS, "Calls taken by the fast case (hits) and passed on (misses)."},
    {"same_structure", (PyCFunction)(void (*)(void))same_structure, METH_FASTCALL,
     "NOTE [region hits]: whether nodes' op entries and wirings equal entries and wirings."},
    {"trace_outputs", (PyCFunction)(void (*)(void))trace_outputs, METH_FASTCALL,
     "NOTE [trace outputs]: (the values a trace's live storages hold, in trace order; partner)."},
    {"bind_values", (PyCFunction)(void (*)(void))bind_values, METH_FASTCALL,
     "NOTE [run tables in C]: bind each value to its array; (bytes, n, large bytes, large n)."},
    {"drop_values", (PyCFunction)(void (*)(void))drop_values, METH_FASTCALL,
     "NOTE [run tables in C]: Value.fail(err) for each flagged value with an array; the un-count."},
    {"unchecked_inputs", unchecked_inputs, METH_O,
     "NOTE [run tables in C]: (i, record, position) of each input whose index checks are unread."},
    {"check_tables", (PyCFunction)(void (*)(void))check_tables, METH_FASTCALL,
     "NOTE [run tables in C]: (weak refs, id -> position) of outs, each value's chk set to rec."},
    {"value_finalizer", (PyCFunction)(void (*)(void))value_finalizer, METH_FASTCALL,
     "NOTE [value finalizer]: Value.__del__ in C, installed on the exact class."},
    {"hit_parts", (PyCFunction)(void (*)(void))hit_parts, METH_FASTCALL,
     "NOTE [hit key parts]: (held, out_sig) of a flush's external inputs and outputs."},
    {"reset_stats", reset_stats, METH_NOARGS, "Zero the counts of stats()."},
    {"ts_changed", ts_changed, METH_NOARGS, "NOTE [thread state memo]: engine.local.ts was set."},
#ifdef DEFERFUSE_HIT_TIMING
    {"hit_timing", hit_timing, METH_NOARGS, "NOTE [hit timing]: (names, rows of ticks); clears."},
#endif
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath",
                                    "deferfuse's C record path (NOTE [C record path]).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (intern_names() < 0) return NULL;
    S.defer_str = PyUnicode_InternFromString("defer");
    S.empty_tuple = PyTuple_New(0);
    S.one = PyLong_FromLong(1);
    S.zero = PyLong_FromLong(0);
    S.loop_boundary = PyUnicode_InternFromString("loop boundary");
    S.dtype_str = PyUnicode_InternFromString("dtype");
    S.memory_format_str = PyUnicode_InternFromString("memory_format");
    S.device_str = PyUnicode_InternFromString("device");
    if (!S.dtype_str || !S.memory_format_str || !S.device_str) return NULL;
    if (!S.defer_str || !S.empty_tuple || !S.one || !S.loop_boundary) return NULL;
    if (PyType_Ready(&TraceStateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&TraceStateType);
    if (PyModule_AddObject(m, "TraceState", (PyObject *)&TraceStateType) < 0) {
        Py_DECREF(&TraceStateType); Py_DECREF(m); return NULL;
    }
    /* NOTE [C++ node hand-over]: {version, record_storages_checked} for _tpu_tensor.cpp; version
       2: its last argument asks for the output Values (NOTE [lazy storages]) */
    static struct {
        long version;
        PyObject *(*record)(PyObject *, PyObject *, PyObject *, long, PyObject *, PyObject *, int);
    } capi = {2, record_storages_checked};
    PyObject *cap = PyCapsule_New(&capi, "deferfuse._fastpath.record_capi", NULL);
    if (cap == NULL || PyModule_AddObject(m, "record_capi", cap) < 0) {
        Py_XDECREF(cap); Py_DECREF(m); return NULL;
    }
    return m;
}
