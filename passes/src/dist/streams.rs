//! Streams and events: which stream each node runs on, and the RecordEvent / WaitEvent pairs
//! that order every use of a value across streams. Used by collective insertion
//! ([`crate::dist::spmd`]) and re-applied by collective rewriting ([`crate::dist::rewrite`])
//! after it changes the graph.

use hzp_ir::{NodeId, Op, Program, StreamKind, Update, ValueDef, ValueId};
use std::collections::{HashMap, HashSet};

/// The stream a node of this op runs on: all-gathers on the all-gather stream, the other
/// collectives on the reduce-scatter stream, everything else on the compute stream.
pub fn stream_for(op: &Op) -> StreamKind {
    match op {
        Op::AllGather { .. } => StreamKind::AllGather,
        Op::ReduceScatter { .. } | Op::AllReduce { .. } | Op::AllToAll { .. } => {
            StreamKind::ReduceScatter
        }
        _ => StreamKind::Compute,
    }
}

/// Puts every node on the stream [`stream_for`] its op.
pub fn assign_streams(p: &mut Program) {
    for n in p.nodes.iter_mut() {
        n.stream = stream_for(&n.op);
    }
}

/// Orders every use across streams: after the producer, a RecordEvent on its stream; before
/// the first reader on each other stream, a WaitEvent. Values that exist before the step
/// (inputs, parameters, states, constants) need none.
pub fn insert_events(p: &Program) -> Program {
    let order: Vec<NodeId> = (0..p.nodes.len()).map(|i| NodeId(i as u32)).collect();
    insert_events_with(p, &order, &[])
}

/// [`insert_events`] with the nodes issued in `order` (a permutation of the nodes that is a
/// topological order) and extra orderings `(waiter, waited)`: `waiter` starts only after
/// `waited` has run (when they are on different streams; `waited` must come first in
/// `order`).
pub fn insert_events_with(p: &Program, order: &[NodeId], extra: &[(NodeId, NodeId)]) -> Program {
    let mut out = Program::new(p.name.clone());
    out.mesh = p.mesh.clone();
    out.precision = p.precision;
    // Sized up front for `p` and its events (not regrown and copied while built).
    out.values.reserve(p.values.len() + p.values.len() / 4);
    out.nodes.reserve(p.nodes.len() + p.nodes.len() / 4);
    // Values are copied in order; nodes are re-added with events interleaved.
    // (a vector by value index, not a hash map: this runs over every value of a large step)
    let mut map: Vec<Option<ValueId>> = vec![None; p.values.len()];
    let at = |map: &[Option<ValueId>], v: ValueId| {
        map[v.index()].expect("a value is defined before it is read")
    };
    // each parameter's data, constant's data and state's initial value (the first entry of
    // one listed twice, as `Program::param` finds it)
    let mut param_data: HashMap<ValueId, &Option<hzp_ir::Tensor>> = HashMap::new();
    for x in &p.params {
        param_data.entry(x.value).or_insert(&x.data);
    }
    let mut const_data: HashMap<ValueId, &hzp_ir::Tensor> = HashMap::new();
    for c in &p.consts {
        const_data.entry(c.value).or_insert(&c.data);
    }
    let mut state_init: HashMap<ValueId, &Option<hzp_ir::Tensor>> = HashMap::new();
    for s in &p.states {
        state_init.entry(s.value).or_insert(&s.init);
    }
    for (i, v) in p.values.iter().enumerate() {
        let id = ValueId(i as u32);
        match v.def {
            ValueDef::Input => {
                map[id.index()] = Some(out.add_input(v.name.clone(), v.ty.clone()));
            }
            ValueDef::Param => {
                let data = param_data.get(&id).and_then(|&d| d.clone());
                map[id.index()] = Some(out.add_param(v.name.clone(), v.ty.clone(), data));
            }
            ValueDef::Const => {
                let data = (*const_data.get(&id).expect("const has data")).clone();
                map[id.index()] = Some(out.add_const(v.name.clone(), data));
            }
            ValueDef::State => {
                let init = state_init.get(&id).and_then(|&s| s.clone());
                map[id.index()] = Some(out.add_state(v.name.clone(), v.ty.clone(), init));
            }
            ValueDef::Node { .. } => {}
        }
    }
    // For each node, the nodes on other streams it must wait for.
    let mut needs: Vec<Vec<usize>> = vec![Vec::new(); p.nodes.len()];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.inputs {
            if let Some(src) = p.producer(v) {
                if p.nodes[src.index()].stream != n.stream {
                    needs[i].push(src.index());
                }
            }
        }
    }
    for &(waiter, waited) in extra {
        if p.nodes[waiter.index()].stream != p.nodes[waited.index()].stream {
            needs[waiter.index()].push(waited.index());
        }
    }
    let mut recorded_for_other = vec![false; p.nodes.len()];
    for ns in &needs {
        for &src in ns {
            recorded_for_other[src] = true;
        }
    }
    let mut event_of: HashMap<usize, u32> = HashMap::new(); // producer node -> event
    let mut waited: HashMap<StreamKind, HashSet<u32>> = HashMap::new();
    let mut next_event = 0u32;
    let mut names = hzp_ir::FreshNames::over(p);
    for &nid in order {
        let ni = nid.index();
        let n = &p.nodes[ni];
        for &src in &needs[ni] {
            let ev = *event_of
                .get(&src)
                .expect("a node is issued after the nodes it waits for");
            if waited.entry(n.stream).or_default().insert(ev) {
                let name = names.fresh(&format!("wait{ev}"));
                out.add_node(name, Op::WaitEvent { event: ev }, vec![], vec![])
                    .expect("events have no inputs");
                out.nodes.last_mut().expect("just added").stream = n.stream;
            }
        }
        let ins = n.inputs.iter().map(|&v| at(&map, v)).collect();
        let outs = n.outputs.iter().map(|&o| p.value(o).name.clone()).collect();
        let new = out
            .add_node(n.name.clone(), n.op.clone(), ins, outs)
            .expect("the program verified before");
        let added = out.nodes.last_mut().expect("just added");
        added.stream = n.stream;
        added.role = n.role.clone();
        for (&o, nv) in n.outputs.iter().zip(new) {
            map[o.index()] = Some(nv);
        }
        if recorded_for_other[ni] {
            let ev = next_event;
            next_event += 1;
            event_of.insert(ni, ev);
            let name = names.fresh(&format!("record{ev}"));
            out.add_node(name, Op::RecordEvent { event: ev }, vec![], vec![])
                .expect("events have no inputs");
            out.nodes.last_mut().expect("just added").stream = n.stream;
        }
    }
    out.outputs = p.outputs.iter().map(|&v| at(&map, v)).collect();
    out.updates = p
        .updates
        .iter()
        .map(|u| Update {
            target: at(&map, u.target),
            value: at(&map, u.value),
        })
        .collect();
    out
}
