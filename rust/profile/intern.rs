//! Tables that store each distinct item once, and what their items cost in memory
//! (the model's items say theirs in `model.rs`).

use rustc_hash::FxHashMap;
use std::hash::Hash;

/// A table that stores each distinct item once and hands out dense ids.
#[derive(Debug)]
pub struct Interner<T> {
    items: Vec<T>,
    index: FxHashMap<T, u32>,
    bytes: usize,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Interner { items: Vec::new(), index: FxHashMap::default(), bytes: 0 }
    }
}

/// Approximate heap bytes an item costs, for the store's memory cap.
pub trait Footprint {
    fn heap_bytes(&self) -> usize;
}

impl Footprint for Vec<u32> {
    fn heap_bytes(&self) -> usize {
        self.len() * 4
    }
}

/// Borrowed names, interned for ids while a profile is read: nothing of their own.
impl Footprint for &str {
    fn heap_bytes(&self) -> usize {
        0
    }
}

impl Footprint for Vec<&str> {
    fn heap_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<&str>()
    }
}

/// Hash-map bookkeeping per entry (hash, control byte, id), on top of the two copies.
const ENTRY_OVERHEAD: usize = 16;

impl<T: Clone + Eq + Hash + Footprint> Interner<T> {
    pub fn intern(&mut self, item: T) -> u32 {
        if let Some(&id) = self.index.get(&item) {
            return id;
        }
        let id = self.items.len() as u32;
        self.bytes += 2 * (item.heap_bytes() + std::mem::size_of::<T>()) + ENTRY_OVERHEAD;
        self.index.insert(item.clone(), id);
        self.items.push(item);
        id
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn find(&self, item: &T) -> Option<u32> {
        self.index.get(item).copied()
    }

    pub fn get(&self, id: u32) -> &T {
        &self.items[id as usize]
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn into_items(self) -> Vec<T> {
        self.items
    }
}

impl Interner<Vec<u32>> {
    /// Interns a stack without allocating when it is already known.
    pub fn intern_slice(&mut self, stack: &[u32]) -> u32 {
        match self.index.get(stack) {
            Some(&id) => id,
            None => self.intern(stack.to_vec()),
        }
    }
}

impl Interner<String> {
    /// Finds a string without allocating.
    pub fn find_str(&self, item: &str) -> Option<u32> {
        self.index.get(item).copied()
    }
}
