/* import-hf's compiled loops over 2-byte items (called through storage/transpose.py), with
 * the GIL released so that the import's workers run them side by side:
 *
 * - the transposing copy it makes of every Hugging Face kernel: 8 x 8 blocks transposed in
 *   SSE2 registers. NumPy's strided copy of the same view moves 0.25 GiB/s here, import-hf's
 *   word-packing NumPy copy (hf/import_hf.py, _transpose: the fallback) 1.8 to 2.0, this 4.1;
 * - the sum of a merged adapter (import-hf --adapter, lora/peft_adapter.py): a bfloat16 weight
 *   plus a scaled float32 delta, rounded to bfloat16, in one pass: NumPy's three (the scale,
 *   the sum through ml_dtypes' cast, the cast back) took 1.6 ns an item here, most of a merge.
 *
 * Built with -ffp-contract=off (setup.py): a product and a sum are each rounded, as NumPy's
 * separate passes round them, never fused into one multiply-add. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

/* s[i * ls + j] -> d[j * ld + i] for i, j < 8 */
static inline void block8(const uint16_t *s, Py_ssize_t ls, uint16_t *d, Py_ssize_t ld) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
  __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * ls));
  __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * ls));
  __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * ls));
  __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * ls));
  __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
  __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
  __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
  __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
  _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(c0, c4));
  _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(c0, c4));
  _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(c1, c5));
  _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(c1, c5));
  _mm_storeu_si128((__m128i *)(d + 4 * ld), _mm_unpacklo_epi64(c2, c6));
  _mm_storeu_si128((__m128i *)(d + 5 * ld), _mm_unpackhi_epi64(c2, c6));
  _mm_storeu_si128((__m128i *)(d + 6 * ld), _mm_unpacklo_epi64(c3, c7));
  _mm_storeu_si128((__m128i *)(d + 7 * ld), _mm_unpackhi_epi64(c3, c7));
}
#else
static inline void block8(const uint16_t *s, Py_ssize_t ls, uint16_t *d, Py_ssize_t ld) {
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) d[j * ld + i] = s[i * ls + j];
}
#endif

/* Source rows a pass: 128 of them, 8 at a time, for every 8 rows of the output. Each output
 * row then gets 256 contiguous bytes a pass (fastest of 16 to 256 here, 8B llama kernels). */
#define GROUP 128

/* d[r * cols + c] = s[c * ld + r] for r < rows, c < cols */
static void transpose2(uint16_t *d, const uint16_t *s, Py_ssize_t rows, Py_ssize_t cols,
                       Py_ssize_t ld) {
  Py_ssize_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (Py_ssize_t c0 = 0; c0 < cols8; c0 += GROUP) {
    Py_ssize_t c1 = c0 + GROUP < cols8 ? c0 + GROUP : cols8;
    for (Py_ssize_t r = 0; r < rows8; r += 8)
      for (Py_ssize_t c = c0; c < c1; c += 8) block8(s + c * ld + r, ld, d + r * cols + c, cols);
  }
  for (Py_ssize_t r = 0; r < rows; r++) /* what the blocks leave: the last columns and rows */
    for (Py_ssize_t c = (r < rows8 ? cols8 : 0); c < cols; c++) d[r * cols + c] = s[c * ld + r];
}

static PyObject *transpose(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *out_obj, *src_obj;
  if (!PyArg_ParseTuple(args, "OO", &out_obj, &src_obj)) return NULL;
  Py_buffer out, src;
  if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
  if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) {
    PyBuffer_Release(&out);
    return NULL;
  }
  PyObject *result = NULL;
  if (out.ndim != 2 || src.ndim != 2 || out.itemsize != 2 || src.itemsize != 2 ||
      out.shape[0] != src.shape[0] || out.shape[1] != src.shape[1]) {
    PyErr_SetString(PyExc_ValueError,
                    "transpose(out, src): two 2-D arrays of one shape and 2-byte items");
  } else if ((src.shape[0] > 1 && src.strides[0] != 2) ||
             (src.shape[1] > 1 && (src.strides[1] < 2 * src.shape[0] || src.strides[1] % 2))) {
    /* a transposed view: its first axis steps one item, its second whole columns */
    PyErr_SetString(PyExc_ValueError,
                    "transpose(out, src): src must be a transposed view (rows of src.T contiguous)");
  } else {
    Py_ssize_t rows = out.shape[0], cols = out.shape[1], ld = src.strides[1] / 2;
    if (rows > 0 && cols > 0) {
      Py_BEGIN_ALLOW_THREADS
      transpose2((uint16_t *)out.buf, (const uint16_t *)src.buf, rows, cols, ld);
      Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&out);
  return result;
}

/* A float32 as the bfloat16 ml_dtypes casts it to: to nearest even, a NaN as the quiet NaN
 * of its sign. */
static inline uint16_t to_bf16(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((b >> 16) & 0x8000u) | 0x7fc0u);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* out[i] = bf16(d[i] * scale + float(w[i])), the product and the sum each rounded in float32
 * (out may be w: each item is read before it is written). */
static void add_scaled(uint16_t *out, const float *d, const uint16_t *w, float scale,
                       Py_ssize_t n) {
  Py_ssize_t i = 0;
#if defined(__SSE2__)
  const __m128 vs = _mm_set1_ps(scale);
  const __m128i zero = _mm_setzero_si128(), one = _mm_set1_epi32(1);
  const __m128i bias = _mm_set1_epi32(0x7fff), sign = _mm_set1_epi32(0x8000);
  const __m128i quiet = _mm_set1_epi32(0x7fc0), half = _mm_set1_epi32(0x8000);
  const __m128i half16 = _mm_set1_epi16((short)0x8000);
  for (; i + 8 <= n; i += 8) {
    __m128i w8 = _mm_loadu_si128((const __m128i *)(w + i));
    __m128i r[2];
    for (int h = 0; h < 2; h++) {
      /* bfloat16 bits in the high half of each float32 */
      __m128i wb = h ? _mm_unpackhi_epi16(zero, w8) : _mm_unpacklo_epi16(zero, w8);
      __m128 p = _mm_mul_ps(_mm_loadu_ps(d + i + 4 * h), vs);
      __m128 x = _mm_add_ps(p, _mm_castsi128_ps(wb));
      __m128i b = _mm_castps_si128(x), top = _mm_srli_epi32(b, 16);
      __m128i even = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(b, bias), _mm_and_si128(top, one)), 16);
      __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(x, x));
      __m128i qnan = _mm_or_si128(_mm_and_si128(top, sign), quiet);
      __m128i v = _mm_or_si128(_mm_and_si128(nan, qnan), _mm_andnot_si128(nan, even));
      r[h] = _mm_sub_epi32(v, half); /* into the signed range _mm_packs_epi32 keeps */
    }
    _mm_storeu_si128((__m128i *)(out + i), _mm_add_epi16(_mm_packs_epi32(r[0], r[1]), half16));
  }
#endif
  for (; i < n; i++) {
    uint32_t wb = (uint32_t)w[i] << 16;
    float wf, p;
    memcpy(&wf, &wb, 4);
    p = d[i] * scale;
    out[i] = to_bf16(p + wf);
  }
}

static PyObject *add_scaled_bf16(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *out_obj, *d_obj, *w_obj;
  float scale;
  if (!PyArg_ParseTuple(args, "OOOf", &out_obj, &d_obj, &w_obj, &scale)) return NULL;
  Py_buffer out, d, w;
  if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
  if (PyObject_GetBuffer(d_obj, &d, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&out);
    return NULL;
  }
  if (PyObject_GetBuffer(w_obj, &w, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&d);
    PyBuffer_Release(&out);
    return NULL;
  }
  PyObject *result = NULL;
  if (out.itemsize != 2 || w.itemsize != 2 || d.itemsize != 4 || out.len != w.len ||
      d.len != 2 * out.len) {
    PyErr_SetString(PyExc_ValueError,
                    "add_scaled_bf16(out, d, w, scale): out and w of 2-byte items, d of 4-byte "
                    "items, as many of each, all C-contiguous");
  } else {
    Py_ssize_t n = out.len / 2;
    Py_BEGIN_ALLOW_THREADS
    add_scaled((uint16_t *)out.buf, (const float *)d.buf, (const uint16_t *)w.buf, scale, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
  }
  PyBuffer_Release(&w);
  PyBuffer_Release(&d);
  PyBuffer_Release(&out);
  return result;
}

static PyMethodDef methods[] = {
    {"transpose", transpose, METH_VARARGS,
     "transpose(out, src): out[...] = src for a C-contiguous 2-D out and a transposed 2-D view "
     "src of 2-byte items, without the GIL."},
    {"add_scaled_bf16", add_scaled_bf16, METH_VARARGS,
     "add_scaled_bf16(out, d, w, scale): out = bfloat16(d * scale + float32(w)) item by item "
     "(d float32, w and out bfloat16 bits, out may be w), each step rounded as NumPy's, "
     "without the GIL."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_transpose",
    "import-hf's compiled loops: the transposing copy of 2-byte items, a merge's bfloat16 sum.",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__transpose(void) { return PyModule_Create(&module); }
