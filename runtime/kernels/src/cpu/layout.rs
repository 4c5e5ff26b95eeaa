//! Strided indexing, the one place that knows how row-major tensors are laid out: strides,
//! numpy broadcasting as stride 0, and a walk over a shape that yields the element offsets
//! of several strided operands at once (used by broadcasting, transposes, slices, expands,
//! tiles and reductions).

/// Row-major strides of a contiguous tensor of `shape`.
pub fn strides_of(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i] as isize;
    }
    s
}

/// Strides that read a contiguous tensor of `in_shape` as if it had `out_shape` (numpy
/// broadcasting: dims are right-aligned, missing and size-1 dims get stride 0). The caller
/// guarantees that `in_shape` broadcasts to `out_shape`.
pub fn broadcast_strides(in_shape: &[usize], out_shape: &[usize]) -> Vec<isize> {
    let own = strides_of(in_shape);
    let lead = out_shape.len() - in_shape.len();
    (0..out_shape.len())
        .map(|i| {
            if i < lead || in_shape[i - lead] == 1 {
                0
            } else {
                own[i - lead]
            }
        })
        .collect()
}

/// Number of elements of a shape, or `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Calls `f(offsets, len, steps)` once per innermost row of `shape`, in row-major order:
/// the row's elements are at `offsets[k] + j * steps[k]` for `j < len` in operand `k`.
/// `base` is each operand's offset of position 0. Size-1 dims are dropped and adjacent dims
/// that are contiguous for every operand merged, so rows are as long as the layout allows.
pub fn walk_rows<const N: usize>(
    shape: &[usize],
    strides: [&[isize]; N],
    base: [isize; N],
    mut f: impl FnMut([isize; N], usize, [isize; N]),
) {
    if shape.contains(&0) {
        return;
    }
    // (size, strides per operand), size-1 dims dropped, contiguous neighbours merged
    let mut dims: Vec<(usize, [isize; N])> = Vec::with_capacity(shape.len());
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let s: [isize; N] = std::array::from_fn(|k| strides[k][d]);
        if let Some(last) = dims.last_mut() {
            if (0..N).all(|k| last.1[k] == s[k] * size as isize) {
                last.0 *= size;
                last.1 = s;
                continue;
            }
        }
        dims.push((size, s));
    }
    let Some(&(inner_n, inner_s)) = dims.last() else {
        f(base, 1, [0; N]);
        return;
    };
    let outer = &dims[..dims.len() - 1];
    let mut idx = vec![0usize; outer.len()];
    let mut off = base;
    loop {
        f(off, inner_n, inner_s);
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            let (size, st) = outer[d];
            for (x, s) in off.iter_mut().zip(st) {
                *x += s;
            }
            if idx[d] < size {
                break;
            }
            for (x, s) in off.iter_mut().zip(st) {
                *x -= s * size as isize;
            }
            idx[d] = 0;
        }
    }
}

/// Calls `f` with the offsets into N strided operands of every position of `shape`, in
/// row-major order of `shape` (see [`walk_rows`]).
pub fn walk<const N: usize>(
    shape: &[usize],
    strides: [&[isize]; N],
    base: [isize; N],
    mut f: impl FnMut([isize; N]),
) {
    walk_rows(shape, strides, base, |mut o, len, step| {
        for _ in 0..len {
            f(o);
            for (x, s) in o.iter_mut().zip(step) {
                *x += s;
            }
        }
    });
}

/// Copies the elements of a strided view of `src` (shape `shape`, `strides`, offset `base`)
/// into `out`, row-major (`out` holds exactly the view's element count).
pub fn gather_strided_into<T: Copy>(
    src: &[T],
    shape: &[usize],
    strides: &[isize],
    base: isize,
    out: &mut [T],
) {
    let n: usize = shape.iter().product();
    assert_eq!(out.len(), n, "strided gather into a buffer of another size");
    if base == 0 && n == src.len() && is_contiguous(shape, strides) {
        out.copy_from_slice(src);
        return;
    }
    let mut at = 0;
    walk_rows(shape, [strides], [base], |[o], len, [step]| {
        let o = o as usize;
        let dst = &mut out[at..at + len];
        match step {
            1 => dst.copy_from_slice(&src[o..o + len]),
            0 => dst.fill(src[o]),
            _ => {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = src[(o as isize + j as isize * step) as usize];
                }
            }
        }
        at += len;
    });
}

/// Whether `strides` are the row-major strides of `shape`.
fn is_contiguous(shape: &[usize], strides: &[isize]) -> bool {
    let mut acc = 1isize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if s != acc {
            return false;
        }
        acc *= d as isize;
    }
    shape.len() == strides.len()
}

/// [`gather_strided_into`] into a new vector.
pub fn gather_strided<T: Copy + Default>(
    src: &[T],
    shape: &[usize],
    strides: &[isize],
    base: isize,
) -> Vec<T> {
    let mut out = vec![T::default(); shape.iter().product()];
    gather_strided_into(src, shape, strides, base, &mut out);
    out
}

/// Broadcasts `src` of `in_shape` to `out_shape` (numpy rules, checked by the caller) into
/// `out`.
pub fn expand_into<T: Copy>(src: &[T], in_shape: &[usize], out_shape: &[usize], out: &mut [T]) {
    let n = out_shape.len();
    let lead = n - in_shape.len();
    // broadcast strides without a vector: at most 8 dims on the stack, else the heap
    let mut small = [0isize; 8];
    let mut big = Vec::new();
    let st: &mut [isize] = if n <= 8 {
        &mut small[..n]
    } else {
        big.resize(n, 0);
        &mut big
    };
    let mut acc = 1isize;
    for i in (0..n).rev() {
        if i >= lead {
            let d = in_shape[i - lead];
            st[i] = if d == 1 { 0 } else { acc };
            acc *= d as isize;
        }
    }
    gather_strided_into(src, out_shape, st, 0, out)
}

/// [`expand_into`] into a new vector.
pub fn expand<T: Copy + Default>(src: &[T], in_shape: &[usize], out_shape: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); out_shape.iter().product()];
    expand_into(src, in_shape, out_shape, &mut out);
    out
}

/// `out = f(a, b)` elementwise with numpy broadcasting of `a` (shape `sa`) and `b` (shape
/// `sb`) to `shape`, written row-major into `out`. Equal shapes and scalar operands take a
/// straight loop.
pub fn zip_broadcast_into<A: Copy, B: Copy, R>(
    (a, sa): (&[A], &[usize]),
    (b, sb): (&[B], &[usize]),
    shape: &[usize],
    out: &mut [R],
    mut f: impl FnMut(A, B) -> R,
) {
    let n: usize = shape.iter().product();
    assert_eq!(out.len(), n, "broadcast into a buffer of another size");
    if a.len() == n && b.len() == n && sa == sb {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
        return;
    }
    if b.len() == 1 && a.len() == n {
        let y = b[0];
        for (o, &x) in out.iter_mut().zip(a) {
            *o = f(x, y);
        }
        return;
    }
    if a.len() == 1 && b.len() == n {
        let x = a[0];
        for (o, &y) in out.iter_mut().zip(b) {
            *o = f(x, y);
        }
        return;
    }
    let (ta, tb) = (broadcast_strides(sa, shape), broadcast_strides(sb, shape));
    let mut at = 0;
    // broadcast strides are 0 or the contiguous stride, so a row steps by 0 or 1
    walk_rows(shape, [&ta, &tb], [0, 0], |[i, j], len, step| {
        let (i, j) = (i as usize, j as usize);
        let dst = &mut out[at..at + len];
        match step {
            [1, 1] => {
                for ((o, &x), &y) in dst.iter_mut().zip(&a[i..i + len]).zip(&b[j..j + len]) {
                    *o = f(x, y);
                }
            }
            [1, 0] => {
                let y = b[j];
                for (o, &x) in dst.iter_mut().zip(&a[i..i + len]) {
                    *o = f(x, y);
                }
            }
            [0, 1] => {
                let x = a[i];
                for (o, &y) in dst.iter_mut().zip(&b[j..j + len]) {
                    *o = f(x, y);
                }
            }
            _ => {
                let (sa, sb) = (step[0] as usize, step[1] as usize);
                for (t, o) in dst.iter_mut().enumerate() {
                    *o = f(a[i + t * sa], b[j + t * sb]);
                }
            }
        }
        at += len;
    });
}

/// Three-operand broadcasting (for Where), written row-major into `out`.
pub fn zip3_broadcast_into<A: Copy, B: Copy, C: Copy, R>(
    a: (&[A], &[usize]),
    b: (&[B], &[usize]),
    c: (&[C], &[usize]),
    shape: &[usize],
    out: &mut [R],
    f: impl Fn(A, B, C) -> R,
) {
    let n: usize = shape.iter().product();
    assert_eq!(out.len(), n, "broadcast into a buffer of another size");
    if a.1 == shape && b.1 == shape && c.1 == shape {
        for (i, o) in out.iter_mut().enumerate() {
            *o = f(a.0[i], b.0[i], c.0[i]);
        }
        return;
    }
    let ta = broadcast_strides(a.1, shape);
    let tb = broadcast_strides(b.1, shape);
    let tc = broadcast_strides(c.1, shape);
    let mut at = 0;
    // broadcast strides are 0 or the contiguous stride, so a row steps by 0 or 1; the
    // common rows (the first operand fixed along the row) get their own loops
    walk_rows(shape, [&ta, &tb, &tc], [0, 0, 0], |[i, j, k], len, step| {
        let (i, j, k) = (i as usize, j as usize, k as usize);
        let dst = &mut out[at..at + len];
        match step {
            [0, 1, 1] => {
                let x = a.0[i];
                for ((o, &y), &z) in dst.iter_mut().zip(&b.0[j..j + len]).zip(&c.0[k..k + len]) {
                    *o = f(x, y, z);
                }
            }
            [0, 0, 1] => {
                let (x, y) = (a.0[i], b.0[j]);
                for (o, &z) in dst.iter_mut().zip(&c.0[k..k + len]) {
                    *o = f(x, y, z);
                }
            }
            [0, 1, 0] => {
                let (x, z) = (a.0[i], c.0[k]);
                for (o, &y) in dst.iter_mut().zip(&b.0[j..j + len]) {
                    *o = f(x, y, z);
                }
            }
            _ => {
                let [si, sj, sk] = step.map(|s| s as usize);
                for (t, o) in dst.iter_mut().enumerate() {
                    *o = f(a.0[i + t * si], b.0[j + t * sj], c.0[k + t * sk]);
                }
            }
        }
        at += len;
    });
}

/// Splits `shape` around `axis` into (outer, dim, inner) element counts.
pub fn around_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_transposed_and_broadcast() {
        // [2,3] transposed to [3,2]
        let src = [0, 1, 2, 3, 4, 5];
        let t = gather_strided(&src, &[3, 2], &[1, 3], 0);
        assert_eq!(t, vec![0, 3, 1, 4, 2, 5]);
        let e = expand(&[1, 2, 3], &[3], &[2, 3]);
        assert_eq!(e, vec![1, 2, 3, 1, 2, 3]);
        let e = expand(&[1, 2], &[2, 1], &[2, 3]);
        assert_eq!(e, vec![1, 1, 1, 2, 2, 2]);
        // negative stride
        let r = gather_strided(&src, &[6], &[-1], 5);
        assert_eq!(r, vec![5, 4, 3, 2, 1, 0]);
        // scalar shape and empty shapes
        assert_eq!(gather_strided(&[7], &[], &[], 0), vec![7]);
        assert!(gather_strided::<i32>(&[], &[0, 3], &[3, 1], 0).is_empty());
    }

    #[test]
    fn zip_general_broadcast() {
        let a = [1, 2]; // [2,1]
        let b = [10, 20, 30]; // [3]
        let mut r = [0; 6];
        zip_broadcast_into((&a, &[2, 1]), (&b, &[3]), &[2, 3], &mut r, |x, y| x + y);
        assert_eq!(r, [11, 21, 31, 12, 22, 32]);
    }
}
